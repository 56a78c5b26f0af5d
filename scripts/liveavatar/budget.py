"""LiveAvatar on N DiT GPUs + 1 decoder GPU: is a block made faster than it plays? From measured stage times.

    python scripts/liveavatar/budget.py   # reads benchmarks/<gpu>/liveavatar_dit.json, writes benchmarks/estimates/

No multi-GPU machine was lent, so a row adds one rank's compute measured on one GPU (`bench_dit.py`: the rank's
share of heads and MLP, every step of the block, the rolling cache full) to a model of that rank's collectives:
Megatron-style tensor parallelism over heads and MLP columns, per layer and forward an all-reduce of the block's
activations after the self-attention, the text cross-attention and the MLP, one after each audio injector, and a
small one for the q/k RMSNorm statistics (their norm spans all heads); each timed as t = alpha + bytes * traffic
/ B with alpha and B fitted to the 2-rank NCCL runs (`scripts/benchmarks/latency_budget.py`'s fit, H200 NVLink 4
/ NVSwitch, as an H100's). The decoder runs on its own GPU beside the DiT (overlapped), so a block keeps real time
when max(rank compute + collectives, decoder) < the block's playback time (12 frames at 25 fps = 480 ms).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.families.liveavatar import LiveAvatarDiTConfig, LiveAvatarLoopConfig
from scripts.benchmarks import results
from scripts.benchmarks.latency_budget import COLLECTIVE_RUNS, _traffic, fit_collectives

ROOT = Path(__file__).resolve().parents[2]


def collectives(ranks: int, cfg: LiveAvatarDiTConfig, loop: LiveAvatarLoopConfig) -> list[tuple[str, int, int]]:
    """(op, calls, bytes) of one rank's collectives per block (all steps), bf16 activations."""
    if ranks == 1:
        return []
    act = loop.block_tokens * cfg.dim * 2
    forwards = loop.steps
    big = forwards * (3 * cfg.num_layers + len(cfg.audio_inject_layers))
    norms = forwards * 2 * cfg.num_layers  # q and k sum-of-squares, (T,) float32 each
    return [("all_reduce", big, act), ("all_reduce", norms, loop.block_tokens * 4)]


def collectives_ms(ranks: int, fit: dict[str, dict[str, float]], cfg: LiveAvatarDiTConfig,
                   loop: LiveAvatarLoopConfig) -> float:
    return sum(calls * (fit[op]["alpha_ms"] + nbytes * _traffic(op, ranks) / fit[op]["bytes_per_ms"])
               for op, calls, nbytes in collectives(ranks, cfg, loop))


def budget(dit: dict[str, Any], fit: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    cfg, loop = LiveAvatarDiTConfig(), LiveAvatarLoopConfig()
    play = loop.block_seconds * 1000
    rows = []
    decoder = next((r["block_ms_p50"] for r in dit["rows"] if r.get("part") == "decoder" and "error" not in r), None)
    for r in dit["rows"]:
        if "part" in r:
            continue
        if "error" in r:
            rows.append({"dit_gpus": r["shard"], "precision": r["precision"], "error": r["error"]})
            continue
        comm = collectives_ms(r["shard"], fit, cfg, loop)
        total = max(r["block_ms_p50"] + comm, decoder or 0.0)  # the decoder GPU works beside the DiT
        rows.append({"dit_gpus": r["shard"], "decoder_gpus": 1, "precision": r["precision"],
                     "rank_compute_ms": r["block_ms_p50"], "collectives_est_ms": round(comm, 1),
                     "block_est_ms": round(total, 1), "playback_ms": play, "real_time": total < play,
                     "fps_est": round(loop.video_frames_per_block / total * 1000, 1),
                     "decoder_ms": decoder, "floor_ms": r["floor_ms"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dit", default=str(ROOT / "benchmarks/h100/liveavatar_dit.json"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/estimates/liveavatar_budget.json"))
    args = ap.parse_args()
    dit = results.latest(Path(args.dit))
    runs = [results.latest(ROOT / "benchmarks/h200x2" / name) for name in COLLECTIVE_RUNS]
    fit = fit_collectives(runs)
    rows = budget(dit, fit)
    print(f"{'GPUs':>6} {'prec':>5} {'rank ms':>8} {'coll ms':>8} {'block ms':>9} {'play ms':>8} {'fps':>6} real time")
    for row in rows:
        if "error" in row:
            print(f"{row['dit_gpus']:>4}+1 {row['precision']:>5} {row['error'][:60]}")
            continue
        print(f"{row['dit_gpus']:>4}+1 {row['precision']:>5} {row['rank_compute_ms']:>8} "
              f"{row['collectives_est_ms']:>8} {row['block_est_ms']:>9} {row['playback_ms']:>8.0f} "
              f"{row['fps_est']:>6} {row['real_time']}")
    results.record(Path(args.out), {"source": args.dit, "device": dit.get("device"), "rows": rows,
                                    "fit": {op: {"alpha_us": round(f["alpha_ms"] * 1e3, 1),
                                                 "bus_GBps": round(f["bytes_per_ms"] / 1e6, 1)}
                                            for op, f in fit.items()}})


if __name__ == "__main__":
    main()
