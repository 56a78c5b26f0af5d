"""Benchmark: CPU time per chunk of the embedded default's compute (DiT + decoder, summed over their threads).

    python scripts/benchmarks/bench_cpu.py                      # tiny, shipped weights, 120 chunks per variant
    python scripts/benchmarks/bench_cpu.py --chunks 200 --variants overlap,sequential

Each variant runs one session of the sample speech through `characters.cpu.StagePipeline`, the same path
as `characters demo`, unpaced, after a warm-up that fills the cache window:

- `overlap`: the DiT of chunk k+1 on the caller's thread beside the decode of chunk k on a second thread,
  one intra-op thread each (the default on 2+ cores);
- `sequential`: both stages one after the other on one thread (the one-core path);
- `sequential_2threads`: the same with 2 intra-op threads per op (what the demo did before).

Per chunk: CPU time of each stage from `time.thread_time` in the thread that ran it (their sum is the
chunk's CPU time when every op runs on its caller's thread, i.e. with one intra-op thread) and, for every
variant, the process's user + system time (`resource.getrusage`) over each chunk's turn, which also counts
intra-op worker threads. Wall time beside it. `--decoders conv` adds the decoder of the previous `tiny`
(full-resolution last stage; random weights: the time does not depend on them) in the same run, for the
ratio. p50 / p95 over >= 100 chunks; the JSON (default benchmarks/cpu/compute_tiny.json) holds the CPU model,
cores, flags, load average before and after, torch version and the command.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from characters.audio import SAMPLE_AUDIO, load_audio  # noqa: E402
from characters.config import TOPOLOGIES, session_config  # noqa: E402
from characters.cpu import StagePipeline, cores, cpu_flags, cpu_model, load_average  # noqa: E402
from characters.engine import CharacterEngine, DecoderRunner  # noqa: E402
from characters.media import SAMPLE_IMAGE, load_image  # noqa: E402
from scripts.benchmarks import results  # noqa: E402

VARIANTS = {"overlap": (True, 1), "sequential": (False, 1), "sequential_2threads": (False, 2)}


def _process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": pct(xs, 50), "p95": pct(xs, 95), "max": max(xs), "mean": statistics.fmean(xs)}


def run_variant(engine: CharacterEngine, image: np.ndarray, speech: np.ndarray, name: str, chunks: int,
                warmup: int) -> dict[str, Any]:
    overlap, threads = VARIANTS[name]
    engine.start(image)
    total = warmup + chunks

    def pcm(k: int) -> np.ndarray:
        a, b = engine.chunk_samples(k)
        out = np.zeros(b - a, np.float32)
        have = speech[a % len(speech):][: b - a]  # the sample speech, looped
        out[: len(have)] = have
        return out

    rows: list[dict[str, float]] = []
    with StagePipeline(engine, overlap=overlap, dit_threads=threads, decoder_threads=threads) as pipe:
        c0 = _process_cpu_s()
        for res in pipe.stream(pcm(k) for k in range(total)):
            c1 = _process_cpu_s()
            rows.append({"dit_cpu_ms": res.dit.cpu_ms, "decode_cpu_ms": res.decode.cpu_ms, "cpu_ms": res.cpu_ms,
                         "process_cpu_ms": (c1 - c0) * 1e3, "wall_ms": res.wall_ms, "dit_wall_ms": res.dit.wall_ms,
                         "decode_wall_ms": res.decode.wall_ms})
            c0 = c1
    rows = rows[warmup:]
    out: dict[str, Any] = {"overlap": overlap, "intra_op_threads": threads, "chunks": len(rows)}
    for key in rows[0]:
        out[key] = summary([r[key] for r in rows])
    return out


def decoder_only(cfg_kw: dict[str, Any], chunks: int, warmup: int) -> dict[str, Any]:
    """One decoder alone on this thread (1 intra-op thread): CPU ms per chunk."""
    torch.set_num_threads(1)
    cfg = session_config("tiny", "cpu", **cfg_kw)
    dec = DecoderRunner(cfg)
    h, w = cfg.model.latent_hw
    z = torch.randn(1, cfg.model.vae.latent_channels, 1, h, w)
    dec.start()
    cpu, wall = [], []
    for i in range(warmup + chunks):
        t, c = time.perf_counter(), time.thread_time()
        dec.decode(z)
        if i >= warmup:
            cpu.append((time.thread_time() - c) * 1e3)
            wall.append((time.perf_counter() - t) * 1e3)
    return {"decoder_output": cfg.model.vae.decoder_output, "cpu_ms": summary(cpu), "wall_ms": summary(wall),
            "weights": "shipped" if dec.weights is not None else "random"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=120, help="timed chunks per variant (>= 100 for the p95)")
    p.add_argument("--warmup", type=int, default=8, help="untimed chunks first (the cache window fills in 4)")
    p.add_argument("--variants", default="overlap,sequential,sequential_2threads")
    p.add_argument("--decoders", default="conv", help="also time these decoder_output kinds alone ('' for none)")
    p.add_argument("--cpu-matmul", default="auto", help="comma list of TopologyConfig.cpu_matmul to run each variant "
                   "with (auto: bfloat16 where the CPU has bf16 dot products); rows are named variant/<resolved>")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu" / "compute_tiny.json"))
    args = p.parse_args()
    load_before = load_average()
    cfg = session_config("tiny", "cpu")
    image = load_image(SAMPLE_IMAGE, cfg.model.generation.height, cfg.model.generation.width)
    speech = load_audio(SAMPLE_AUDIO)
    t0 = time.perf_counter()
    rows = {}
    for choice in filter(None, args.cpu_matmul.split(",")):
        topology = TOPOLOGIES["cpu"].model_copy(update={"cpu_matmul": choice}).model_dump()
        engine = CharacterEngine(session_config("tiny", topology))
        for name in filter(None, args.variants.split(",")):
            rows[f"{name}/{engine.dit.cpu_matmul}"] = run_variant(engine, image, speech, name, args.chunks, args.warmup)
    decoders = {"serving (" + cfg.model.vae.decoder_output + ")": decoder_only({}, args.chunks, args.warmup)}
    for kind in filter(None, args.decoders.split(",")):
        if kind != cfg.model.vae.decoder_output:
            decoders[kind] = decoder_only({"model": {"vae": {"decoder_output": kind}}, "weights": "random"},
                                          args.chunks, args.warmup)
    result = {
        "command": " ".join(["python", *sys.argv]), "preset": "tiny",
        "denoising_steps": cfg.model.generation.denoising_steps, "cpu_model": cpu_model(), "cores": cores(),
        "cpu_count": os.cpu_count(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_before": load_before, "load_average_after": load_average(),
        "budget_cpu_ms": 100.0, "chunk_budget_ms": 1000 * cfg.model.generation.frames_per_chunk / 24,
        "weights": str(engine.dit.weights.relative_to(ROOT)) if engine.dit.weights else "random",
        "vae": cfg.model.vae.model_dump(), "seconds": time.perf_counter() - t0,
        "variants": rows, "decoders_alone": decoders,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results.record(out, result)
    print(f"tiny on {result['cpu_model']}, {result['cores']} cores, load average {load_before} -> "
          f"{result['load_average_after']}")
    print(f"{'variant':<28} {'CPU ms p50':>10} {'p95':>7} {'process p50':>11} {'p95':>7} {'wall p50':>9} {'p95':>7}"
          f" {'DiT cpu':>8} {'dec cpu':>8}")
    for name, r in rows.items():
        print(f"{name:<28} {r['cpu_ms']['p50']:>10.1f} {r['cpu_ms']['p95']:>7.1f} {r['process_cpu_ms']['p50']:>11.1f} "
              f"{r['process_cpu_ms']['p95']:>7.1f} {r['wall_ms']['p50']:>9.1f} {r['wall_ms']['p95']:>7.1f} "
              f"{r['dit_cpu_ms']['p50']:>8.1f} {r['decode_cpu_ms']['p50']:>8.1f}")
    for name, r in decoders.items():
        print(f"decoder {name:<14} CPU p50 {r['cpu_ms']['p50']:.1f} ms, p95 {r['cpu_ms']['p95']:.1f}")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
