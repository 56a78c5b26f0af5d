"""Identity kept: generated frames against their framed reference, for the sample face and portrait photos.

    nice -n 10 python scripts/benchmarks/eval_identity.py            # sample face + grace_hopper.jpg, 10 s each
    python scripts/benchmarks/eval_identity.py --seconds 4 --out /tmp/identity.json
    python scripts/benchmarks/eval_identity.py --demo 2     # CPU per chunk of `characters demo --realtime`, A/B

Each picture is framed as a session frames it (`characters.media.frame_reference`), then the shipped `tiny`
engine speaks the sample speech over it (`--seconds`, silence past its end), once with the identity anchor
(`characters.identity`, what sessions do) and once without (the decoder's own frames). Scores per run
(`characters.identity.identity_scores`): PSNR outside the mouth box over all frames, mean signed error per
channel (R, G, B), flicker (mean absolute frame-to-frame difference). Photos come from PyPI packages the project
installs (matplotlib's sample data), never from its training set. Writes benchmarks/cpu/identity_tiny.json.

`--demo N`: instead, what the anchor costs the real-time demo: `characters demo --realtime` (10 s, the sample
face) N times without and N times with the anchor, alternated, in this process; CPU per chunk (p50, p95), late
chunks and the 1-minute load before each run (quiet machines only: a load over 1.5 is refused).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from characters.audio import SAMPLE_AUDIO, load_audio  # noqa: E402
from characters.config import TOPOLOGIES, session_config  # noqa: E402
from characters.engine import CharacterEngine  # noqa: E402
from characters.identity import identity_scores  # noqa: E402
from characters.media import SAMPLE_IMAGE, frame_reference  # noqa: E402
from characters.train.evaluate import generate  # noqa: E402
from scripts.benchmarks import results  # noqa: E402


def photos() -> dict[str, Path]:
    """The pictures scored: the bundled sample face and the portrait photo shipped in matplotlib's wheel."""
    import matplotlib

    return {"sample_face": SAMPLE_IMAGE,
            "grace_hopper": Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"}


def score_picture(engine: CharacterEngine, path: Path, pcm: np.ndarray, frames: int, seed: int,
                  anchor: bool) -> tuple[dict[str, object], np.ndarray, np.ndarray]:
    """One session over `path`: its scores, frames (F, H, W, 3) uint8 and framed reference (H, W, 3) uint8."""
    g = engine.cfg.model.generation
    ref, framing = frame_reference(path, g.height, g.width)
    if framing.face_box is None:
        raise SystemExit(f"{path}: {framing.describe()}; the identity scores need a face")
    t0 = time.perf_counter()
    video = generate(engine.dit, engine.encoder, engine.decoder, ref, pcm, frames, seed=seed, anchor=anchor)
    assert video is not None
    s = identity_scores(video, ref, framing.face_box)
    return {**s.as_dict(), "anchor": anchor, "face_box": list(framing.face_box), "extended": framing.extended,
            "generate_s": time.perf_counter() - t0}, video, ref


def demo_ab(repeats: int, seconds: float) -> dict[str, object]:
    """`characters demo --realtime` without and with the anchor, alternated `repeats` times."""
    import os
    import tempfile

    from characters.demo import run_demo

    cfg = session_config("tiny", "cpu", seed=0, dtype="float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for anchor in (False, True):
                load = os.getloadavg()[0]
                if load > 1.5:
                    raise SystemExit(f"load {load:.2f} > 1.5: other jobs share the cores; retry when quiet")
                r = run_demo(cfg, out=Path(tmp) / "demo.mp4", seconds=seconds, realtime=True, anchor=anchor)
                rows.append({"anchor": anchor, "repeat": i, "cpu_ms_p50": r.cpu_ms_p50, "cpu_ms_p95": r.cpu_ms_p95,
                             "decode_ms_p50": r.decode_ms_p50, "late_chunks": r.late_chunks, "chunks": r.chunks,
                             "load_before": load})
                print(f"anchor {'on ' if anchor else 'off'}: CPU per chunk p50 {r.cpu_ms_p50:.1f} ms, p95 "
                      f"{r.cpu_ms_p95:.1f}, decode p50 {r.decode_ms_p50:.1f}, {r.late_chunks} late of {r.chunks} "
                      f"(load {load:.2f})", flush=True)
    return {"seconds": seconds, "runs": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of video per picture")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--demo", type=int, default=0, help="instead: the real-time demo's CPU, N times off and on")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu" / "identity_tiny.json"))
    args = p.parse_args()
    if args.demo:
        results.record(Path(args.out), demo_ab(args.demo, args.seconds), label="demo_cpu")
        print(f"-> {args.out}")
        return
    torch.set_num_threads(args.threads)
    cfg = session_config("tiny", TOPOLOGIES["cpu"].model_dump())
    engine = CharacterEngine(cfg)
    frames = int(args.seconds * cfg.model.generation.fps) // 4 * 4
    pcm = load_audio(SAMPLE_AUDIO)
    rows: dict[str, dict[str, object]] = {}
    for name, path in photos().items():
        for anchor in (False, True):
            rows[f"{name}{'' if anchor else ' (no anchor)'}"] = score_picture(engine, path, pcm, frames, args.seed,
                                                                               anchor)[0]
    figures = {"seconds": frames / cfg.model.generation.fps, "threads": args.threads, "seed": args.seed,
               "audio": SAMPLE_AUDIO.name, "pictures": rows}
    results.record(Path(args.out), figures, label="identity")
    print(f"identity over {frames / cfg.model.generation.fps:.0f} s of speech (frames against the framed reference)")
    print(f"{'picture':<28} {'PSNR out dB':>11} {'signed R':>9} {'G':>6} {'B':>6} {'flicker':>8}")
    for name, r in rows.items():
        e = r["signed_error_rgb"]
        assert isinstance(e, list)
        print(f"{name:<28} {r['psnr_outside_mouth_db']:>11.2f} {e[0]:>+9.2f} {e[1]:>+6.2f} {e[2]:>+6.2f} "
              f"{r['flicker']:>8.3f}")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
