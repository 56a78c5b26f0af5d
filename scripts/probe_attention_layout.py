"""Probe: does the query's memory layout change SDPA's speed on the 57b rank's real attention shapes?

    python scripts/probe_attention_layout.py --out benchmarks/h200/attention_layout.json

The write-time cache path hands attention a token-major q (a (B, Hh, T, Dh) view of (B, T, Hh, Dh)) so
the output comes back token-major for the output projection. This times cuDNN and flash SDPA with that
q against a head-major (contiguous) q, on one chunk's tokens over the full cache. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_step import env_info, timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2992)
    p.add_argument("--context", type=int, default=5 * 2992)
    p.add_argument("--heads", type=int, default=18)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--out", default="benchmarks/attention_layout.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    b, t, s, hh, dh = 1, args.tokens, args.context, args.heads, args.head_dim
    k = torch.randn(b, hh, s, dh, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q_tok = torch.randn(b, t, hh, dh, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    q_head = q_tok.contiguous()
    flops = 4 * b * hh * t * s * dh
    rows = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        for layout, q in (("token_major_q", q_tok), ("head_major_q", q_head)):
            with sdpa_kernel([backend]), torch.inference_mode():
                ms = statistics.median(timed(lambda q=q: torch.nn.functional.scaled_dot_product_attention(q, k, v),
                                             dev, 30, 5))
            rows[f"{name}_{layout}"] = {"ms": ms, "tflops": flops / ms / 1e9}
    result = {"command": " ".join(["python", *sys.argv]), **env_info(dev),
              "shape": {"B": b, "Tq": t, "S": s, "Hh": hh, "Dh": dh}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, r in rows.items():
        print(f"{name:<28} {r['ms']:7.3f} ms {r['tflops']:6.0f} TFLOP/s")


if __name__ == "__main__":
    main()
