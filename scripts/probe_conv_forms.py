"""Probe: one full-resolution decoder conv (57b: 96 -> 96 channels, 3x3x3, 4 frames + 2 cached, 704x1088)
in several equivalent forms, to see which cuDNN path is fastest on this GPU.

    python scripts/probe_conv_forms.py --out benchmarks/h200/conv_forms.json

Forms: conv3d channels-last (the serving form), conv3d NCDHW, three per-tap conv2d channels-last summed,
and conv3d with cin/cout zero-padded to 128. Prints ms and TFLOP/s (useful FLOPs), writes JSON. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.bench_step import env_info, timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", type=int, default=96)
    p.add_argument("--frames", type=int, default=4)
    p.add_argument("--height", type=int, default=704)
    p.add_argument("--width", type=int, default=1088)
    p.add_argument("--out", default="benchmarks/conv_forms.json")
    args = p.parse_args()
    dev, c, t, h, w = torch.device("cuda"), args.channels, args.frames, args.height, args.width
    torch.backends.cudnn.benchmark = True
    cl = torch.channels_last_3d
    x = torch.randn(1, c, t + 2, h, w, device=dev, dtype=torch.bfloat16)
    wt = torch.randn(c, c, 3, 3, 3, device=dev, dtype=torch.bfloat16) * 0.03
    x_cl, w_cl = x.contiguous(memory_format=cl), wt.contiguous(memory_format=cl)
    pad = 128 - c
    x_pad = F.pad(x, (0, 0, 0, 0, 0, 0, 0, pad)).contiguous(memory_format=cl) if pad > 0 else x_cl
    w_pad = F.pad(wt, (0, 0, 0, 0, 0, 0, 0, pad, 0, pad)).contiguous(memory_format=cl) if pad > 0 else w_cl
    frames = x_cl.permute(0, 2, 1, 3, 4)[0]  # (T + 2, c, h, w), channels-last 2-D frames
    w2 = [wt[:, :, k].contiguous(memory_format=torch.channels_last) for k in range(3)]

    def per_tap() -> torch.Tensor:
        out = F.conv2d(frames[0:t], w2[0], padding=1)
        for k in (1, 2):
            out.add_(F.conv2d(frames[k : k + t], w2[k], padding=1))
        return out

    forms = {
        "conv3d_channels_last": lambda: F.conv3d(x_cl, w_cl, padding=(0, 1, 1)),
        "conv3d_ncdhw": lambda: F.conv3d(x, wt, padding=(0, 1, 1)),
        "per_tap_conv2d_channels_last": per_tap,
        "conv3d_channels_last_padded_128": lambda: F.conv3d(x_pad, w_pad, padding=(0, 1, 1)),
    }
    flops = 2 * c * c * 27 * t * h * w
    ref = forms["conv3d_ncdhw"]().float()
    rows = {}
    with torch.inference_mode():
        for name, fn in forms.items():
            got = fn()[:, :c].float() if "padded" in name else fn().float()
            got = got.reshape(ref.shape) if name != "per_tap_conv2d_channels_last" else got.permute(1, 0, 2, 3)[None]
            err = ((got - ref).norm() / ref.norm()).item()
            ms = statistics.median(timed(fn, dev, 20, 3))
            rows[name] = {"ms": ms, "useful_tflops": flops / ms / 1e9, "rel_err": err}
    result = {"command": " ".join(["python", *sys.argv]), **env_info(dev),
              "shape": {"c": c, "frames": t, "h": h, "w": w}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, r in rows.items():
        print(f"{name:<34} {r['ms']:7.2f} ms {r['useful_tflops']:6.0f} TFLOP/s  err {r['rel_err']:.1e}")


if __name__ == "__main__":
    main()
