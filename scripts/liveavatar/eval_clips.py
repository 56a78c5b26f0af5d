"""Lip sync of LiveAvatar on your own clips: each clip (a video of one person speaking, with its sound) gives a
reference (its first frame) and speech (its audio); LiveAvatar makes a video from them, and both videos are
scored the same way: the mouth's opening (the luminance drop in a box below the detected face against the
reference) correlated with the speech envelope per frame, at offsets -5..+5 frames. The clip's own score is the
ceiling. Needs the fetched weights (`characters weights fetch liveavatar`) and, for speed, a GPU.

    python scripts/liveavatar/eval_clips.py --ckpt ckpt --device cuda --out lipsync_liveavatar.json clips/*.mp4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from characters.audio import load_audio
from characters.media import detect_face, read_mp4
from characters.train.lipsync import luminance, offset_correlations
from characters.train.speech import frame_envelope

FPS = 25


def mouth_box(face: tuple[int, int, int, int], height: int, width: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the mouth in a frontal face box (x, y, w, h): its lower middle."""
    x, y, w, h = face
    top, bot = y + int(0.62 * h), min(height, y + int(0.95 * h))
    left, right = x + int(0.25 * w), min(width, x + int(0.75 * w))
    return top, bot, left, right


def mouth_signal(frames: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    """(F,) mean luminance drop in the box against the first frame (the mouth opening darkens it)."""
    top, bot, left, right = box
    region = luminance(frames[:, top:bot, left:right])
    return np.clip(region[0][None] - region, 0.0, None).mean(axis=(1, 2))


def score(frames: np.ndarray, pcm: np.ndarray, fps: float) -> dict[str, object]:
    face = detect_face(frames[0])
    if face is None:
        return {"error": "no face found in the first frame"}
    signal = mouth_signal(frames, mouth_box(face, *frames.shape[1:3]))
    r = offset_correlations(signal, frame_envelope(pcm, len(signal), fps=round(fps)))
    best = max(r, key=lambda d: (r[d], -abs(d)))
    return {"r": r[best], "offset": best, "r_per_offset": {str(k): v for k, v in r.items()}, "frames": len(signal)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("clips", nargs="+", help="MP4 (or any PyAV video) files with sound")
    ap.add_argument("--ckpt", default="ckpt", help="the folder `characters weights fetch liveavatar` filled")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", default="A person is talking to the camera.")
    ap.add_argument("--seconds", type=float, default=20.0, help="at most this much of each clip")
    ap.add_argument("--out", default=None, help="JSON of the per-clip and mean scores")
    args = ap.parse_args()
    import torch

    from characters.families.liveavatar.pipeline import LiveAvatarPipeline

    pipe = LiveAvatarPipeline.from_snapshot(args.ckpt, device=args.device,
                                            dtype=torch.bfloat16 if args.device != "cpu" else torch.float32)
    rows = []
    for clip in args.clips:
        frames, fps, _, _ = read_mp4(clip)
        pcm = load_audio(clip, max_seconds=args.seconds)
        frames = frames[: int(args.seconds * fps)]
        avatar = pipe.avatar(frames[0], args.prompt)
        made = np.concatenate(list(pipe.frames(avatar, pcm)))[: int(len(pcm) / 16000 * FPS)]
        rows.append({"clip": clip, "generated": score(made, pcm, FPS), "ground_truth": score(frames, pcm, fps)})
        print(json.dumps(rows[-1]["generated"] | {"clip": clip, "truth_r": rows[-1]["ground_truth"].get("r")}))
    ok = [r for r in rows if "r" in r["generated"]]
    summary = {"clips": len(rows), "scored": len(ok),
               "r_mean": float(np.mean([r["generated"]["r"] for r in ok])) if ok else None,
               "truth_r_mean": float(np.mean([r["ground_truth"]["r"] for r in ok if "r" in r["ground_truth"]]))
               if ok else None, "rows": rows}
    print(f"LiveAvatar lip sync: r {summary['r_mean']} over {len(ok)} clips (their own videos: "
          f"{summary['truth_r_mean']})")
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
