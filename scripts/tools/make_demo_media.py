"""Frame strip (PNG) and GIF of `characters demo` with the trained tiny weights, for the README.

    nice -n 10 python scripts/tools/make_demo_media.py          # -> docs/tiny_demo_strip.png, docs/tiny_demo.gif

Two sessions through `characters.demo.run_demo`, as `characters demo` runs them: the bundled sample face with
the bundled speech, and a held-out identity (a face the model never saw) with a held-out sentence. The strip
shows 8 consecutive-ish frames of each (every 3rd frame from the first loud stretch) above a bar of the audio
loudness of each frame; the GIF plays 3 s of both side by side at 8 fps with the same bar.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from characters.audio import SAMPLE_AUDIO, load_audio  # noqa: E402
from characters.config import session_config  # noqa: E402
from characters.demo import run_demo  # noqa: E402
from characters.media import read_mp4  # noqa: E402
from characters.train.data import TEST_CLIPS, TRAIN_CLIPS, load_or_build, reference_image  # noqa: E402
from characters.train.speech import frame_envelope  # noqa: E402

BAR = 8


def with_bar(frame: np.ndarray, level: float) -> np.ndarray:
    """The frame with a loudness bar (level in [0, 1]) under it."""
    bar = np.full((BAR, frame.shape[1], 3), 235, np.uint8)
    bar[2:-2, 2:2 + int(level * (frame.shape[1] - 4))] = (220, 60, 60)
    return np.concatenate([frame, bar])


def session(image: Path, audio: Path, seconds: float, weights: str | None, tmp: Path) -> tuple[np.ndarray, np.ndarray]:
    out = tmp / f"{image.stem}.mp4"
    run_demo(session_config("tiny", "cpu", weights=weights), out=out, image=image, audio=audio, seconds=seconds)
    frames, _, _, _ = read_mp4(out)
    env = frame_envelope(load_audio(audio), len(frames))
    return frames, np.clip((env - env.max() + 30) / 30, 0, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=None)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--clip", type=int, default=4, help="held-out clip (index into the test split)")
    p.add_argument("--out", default=str(ROOT / "docs"))
    args = p.parse_args()
    torch.set_num_threads(2)
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        clip = load_or_build(ROOT / ".cache" / "tiny_data", TRAIN_CLIPS, TEST_CLIPS)[1][args.clip]
        face, speech = tmp / "heldout_face.png", tmp / "heldout_speech.wav"
        Image.fromarray(reference_image(clip.identity)).save(face)
        import wave

        with wave.open(str(speech), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes(np.round(clip.pcm * 32767).astype("<i2").tobytes())
        runs = [session(ROOT / "characters" / "assets" / "sample_face.png", SAMPLE_AUDIO, args.seconds, args.weights,
                        tmp), session(face, speech, args.seconds, args.weights, tmp)]
    rows = []
    for frames, level in runs:
        start = int(np.argmax(level > 0.6))  # the first loud frame
        pick = [min(len(frames) - 1, start + 3 * i) for i in range(8)]
        rows.append(np.concatenate([with_bar(frames[f], level[f]) for f in pick], axis=1))
    out.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(rows, axis=0)).quantize(128).save(out / "tiny_demo_strip.png", optimize=True)
    n = min(len(runs[0][0]), len(runs[1][0]))
    step = 3  # every 3rd frame: 8 fps, 3 s
    gif = [Image.fromarray(np.concatenate([with_bar(fr[f], lv[f]) for fr, lv in runs], axis=1)).quantize(64)
           for f in range(0, min(n, 72), step)]
    gif[0].save(out / "tiny_demo.gif", save_all=True, append_images=gif[1:], duration=1000 * step // 24, loop=0,
                optimize=True)
    for name in ("tiny_demo_strip.png", "tiny_demo.gif"):
        print(f"{out / name}: {(out / name).stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
