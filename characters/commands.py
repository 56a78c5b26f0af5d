"""The model-level commands of `characters`: presets and demo (`serve` is added by deployments.cli)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from characters.config import MODEL_PRESETS, TOPOLOGIES, explain, session_config


def _presets(_: argparse.Namespace) -> int:
    from characters.flops import H200_BF16_RATE, H200_FP8_RATE, chunk_collectives, chunk_cost, rank_memory

    budget = 1000 * 4 / 24  # ms per 4-frame chunk at 24 fps
    print(f"{'preset':<9} {'params':>8} {'resolution':>10} {'tok/chunk':>9} {'keys':>6} {'steps':>5} "
          f"{'TFLOP/chunk':>11} {'topology':>8} {'ranks':>5} {'TFLOP/rank':>10} {'bf16 floor':>10} {'fp8 floor':>9}")
    for name, model in MODEL_PRESETS.items():
        g = model.generation
        steps = f"{g.denoising_steps}" + ("+1" if g.cache_update == "extra_pass" else "")
        for topo in TOPOLOGIES:
            try:
                cfg = session_config(name, topo)
            except ValueError as err:
                print(f"{name:<9} {'':>8} {'':>10} {'':>9} {'':>6} {'':>5} {'':>11} {topo:>8}  n/a: {explain(err)}")
                continue
            c = chunk_cost(cfg)
            bf16_ms, fp8_ms = c.floor_ms(H200_BF16_RATE), c.floor_ms(H200_BF16_RATE, H200_FP8_RATE)
            print(f"{name:<9} {c.params / 1e9:>7.3f}B {g.width:>5}x{g.height:<4} {c.tokens_per_chunk:>9} "
                  f"{c.cache_tokens:>6} {steps:>5} {c.flops_per_chunk / 1e12:>11.3f} {topo:>8} "
                  f"{cfg.topology.dit_ranks:>5} {c.flops_per_chunk_per_rank / 1e12:>10.3f} {bf16_ms:>8.1f}ms "
                  f"{fp8_ms:>7.1f}ms")
    print(f"floors: one DiT rank's FLOPs per chunk at the lent H200's measured rates ({H200_BF16_RATE / 1e12:.0f} "
          f"TFLOP/s bf16, {H200_FP8_RATE / 1e12:.0f} FP8 linear layers with attention in bf16), compute only; "
          f"budget {budget:.1f} ms per chunk")
    print("measured 57b rank steps (benchmarks/h200/step_57b_tp*_fp8.json, communication excluded, sequence "
          "parallel): h100x4 (3 + 1) bf16 205.0 ms, FP8 151.4 ms; h100x5 (4 + 1) bf16 156.3, FP8 116.0 ms")
    print("57b, sequence parallel in FP8 (and its KV cache), per rank: parameters, what the rank holds (weights + KV "
          "cache, cuDNN's FP8 form; activations and CUDA graphs come on top) and collectives a chunk, every layer "
          "split -> the token-local layers whole (topology.local_layers) -> self-attention whole too "
          "(topology.local_attention)")
    for topo in ("h100x4", "h100x5"):
        rows = []
        for local, attention in ((False, False), (True, False), (True, True)):
            t = TOPOLOGIES[topo].model_copy(update={"sequence_parallel": True, "local_layers": local,
                                                    "local_attention": attention})
            cfg = session_config("57b", t.model_dump(), dtype="bfloat16",
                                 model={"precision": "fp8", "attention_precision": "fp8"})
            calls, held = chunk_collectives(cfg), rank_memory(cfg)
            rows.append((chunk_cost(cfg).params_per_rank / 1e9, sum(c.calls for c in calls),
                         sum(c.calls * c.bytes for c in calls) / 1e9,
                         f"{held.weights_bytes / 1e9:.1f} + {held.cache_bytes / 1e9:.1f}"))
        print(f"  {topo}: " + " -> ".join(f"{r[0]:.1f} B" for r in rows) + " parameters, "
              + " -> ".join(f"{r[3]}" for r in rows) + " GB held, "
              + " -> ".join(str(r[1]) for r in rows) + " calls, "
              + " -> ".join(f"{r[2]:.1f}" for r in rows) + " GB of tensors (whole)")
    _liveavatar_presets(H200_BF16_RATE, H200_FP8_RATE)
    return 0


def _liveavatar_presets(bf16_rate: float, fp8_rate: float) -> None:
    from characters.families.liveavatar import LiveAvatarDiTConfig, LiveAvatarLoopConfig
    from characters.families.liveavatar.flops import block_cost

    cfg, loop = LiveAvatarDiTConfig(), LiveAvatarLoopConfig()
    play = loop.block_seconds * 1000
    print(f"liveavatar-14b (family liveavatar): {loop.width}x{loop.height} at {loop.fps} fps, "
          f"{loop.block_tokens} tokens a block of {loop.video_frames_per_block} frames ({play:.0f} ms), "
          f"{loop.steps} steps, {loop.cache_slots} cached tokens a step; per DiT rank: TFLOP a block, "
          "bf16 / FP8-linear floors, weights + caches (bf16)")
    for ranks in (1, 2, 4):
        c = block_cost(cfg, loop, ranks)
        bf16 = c.flops_per_rank / bf16_rate * 1e3
        fp8 = (c.linear_flops_per_rank / fp8_rate + (c.flops_per_rank - c.linear_flops_per_rank) / bf16_rate) * 1e3
        print(f"  {ranks} + 1: {c.params / 1e9:.2f}B params, {c.flops_per_rank / 1e12:.1f} TFLOP, {bf16:.0f} / "
              f"{fp8:.0f} ms, {c.weights_gb_per_rank:.1f} + {c.cache_gb_per_rank:.1f} GB")


def _demo(args: argparse.Namespace) -> int:
    from characters.demo import run_demo
    from characters.media import MediaError

    overrides = {"generation": {"cache_mode": args.cache_mode}} if args.cache_mode else {}
    weights = "random" if args.random_weights else args.weights
    cfg = session_config(args.preset, "cpu" if args.device == "cpu" else "gpu1", seed=args.seed,
                         dtype="float32" if args.device == "cpu" else "bfloat16", model=overrides, weights=weights)
    try:
        report = run_demo(cfg, out=args.out, image=args.image, audio=args.audio, seconds=args.seconds,
                          realtime=args.realtime, device=args.device, settle=True,
                          on_calibration=lambda cal: print(f"characters demo: {cal.advice()}", file=sys.stderr,
                                                           flush=True))
    except (MediaError, FileNotFoundError, ValueError) as err:
        print(f"characters demo: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=1))
    if not report.face_found:
        print(f"characters demo: {report.framing}", file=sys.stderr)
    if args.realtime:
        print(f"generated {report.delivered_fps:.2f} fps over the playout (every frame generated; a late chunk is a "
              f"freeze), {report.late_chunks} late chunks of {report.chunks}, step p50 {report.step_ms_p50:.1f} ms "
              f"(budget {1000 * cfg.model.generation.frames_per_chunk / 24:.1f}), CPU per chunk p50 "
              f"{report.cpu_ms_p50:.1f} ms")
    return 0


def _weights(args: argparse.Namespace) -> int:
    from characters.families.liveavatar.hub import fetch, missing_files

    if args.action == "check":
        gone = missing_files(args.dest)
        print(f"characters weights: {args.dest} " + (f"lacks {gone}" if gone else "holds every LiveAvatar file"),
              file=sys.stderr if gone else sys.stdout)
        return 2 if gone else 0
    try:
        dest = fetch(args.dest, cache_dir=args.cache_dir, local_files_only=args.offline)
    except (OSError, ImportError, ValueError) as err:  # the hub's errors are OSError / ValueError subclasses
        print(f"characters weights: {err}", file=sys.stderr)
        return 2
    print(f"characters weights: LiveAvatar is in {dest}")
    return 0


def build_parser(extend: Callable[[Any], None] | None = None) -> argparse.ArgumentParser:
    """The parser; `extend(subparsers)` lets a higher layer add its commands (deployments adds `serve`)."""
    p = argparse.ArgumentParser(prog="characters", description="Real-time video characters.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("presets", help="print each preset's size, resolution, tokens and FLOPs per chunk").set_defaults(
        func=_presets)
    d = sub.add_parser("demo", help="run one session in this process and write an MP4 with audio")
    d.add_argument("--image", help="reference image (PNG/JPEG/...); default: the bundled sample face")
    d.add_argument("--audio", help="speech audio (WAV/MP3/...); default: the bundled sample speech")
    d.add_argument("--seconds", type=float, default=10.0, help="length of video to generate (default 10)")
    d.add_argument("--preset", default="tiny", choices=sorted(MODEL_PRESETS))
    d.add_argument("--realtime", action="store_true", help="pace chunks at 24 fps and report late chunks")
    d.add_argument("--out", default="out.mp4", help="output MP4 path (default out.mp4)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    d.add_argument("--cache-mode", choices=["write_time", "naive"], default=None)
    w = d.add_mutually_exclusive_group()
    w.add_argument("--weights", default=None, help="checkpoint directory (default: the preset's shipped weights, "
                   "if any, else seeded random ones)")
    w.add_argument("--random-weights", action="store_true", help="seeded random weights instead of trained ones")
    d.set_defaults(func=_demo)
    wt = sub.add_parser("weights", help="fetch or check a public model's published files (liveavatar)")
    wt.add_argument("action", choices=["fetch", "check"])
    wt.add_argument("model", choices=["liveavatar"])
    wt.add_argument("--dest", default="ckpt", help="folder the model's files appear in (default ./ckpt)")
    wt.add_argument("--cache-dir", default=None, help="huggingface_hub cache (default: its own, HF_HOME)")
    wt.add_argument("--offline", action="store_true", help="take the files from the cache only (no network)")
    wt.set_defaults(func=_weights)
    if extend is not None:
        extend(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
