"""The README's identity picture: each reference (framed as a session frames it) beside generated frames.

    python scripts/tools/make_identity_images.py            # -> docs/identity.png

Rows: the bundled sample face and matplotlib's grace_hopper.jpg (the pictures `eval_identity.py` scores).
Columns: the framed reference, then frames the shipped `tiny` engine generated over the sample speech, with the
identity anchor (`characters.identity`), and one frame without it (the decoder's own), labelled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from characters.audio import SAMPLE_AUDIO, load_audio  # noqa: E402
from characters.config import TOPOLOGIES, session_config  # noqa: E402
from characters.engine import CharacterEngine  # noqa: E402
from scripts.benchmarks.eval_identity import photos, score_picture  # noqa: E402

PICKED = (30, 43, 58)  # generated frames shown (24 fps): mouth shapes of the sample speech


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "identity.png"))
    args = p.parse_args()
    torch.set_num_threads(2)
    engine = CharacterEngine(session_config("tiny", TOPOLOGIES["cpu"].model_dump()))
    pcm = load_audio(SAMPLE_AUDIO)
    frames = (max(PICKED) // 4 + 1) * 4
    rows = []
    for path in photos().values():
        _, anchored, ref = score_picture(engine, path, pcm, frames, 0, anchor=True)
        _, raw, _ = score_picture(engine, path, pcm, frames, 0, anchor=False)
        rows.append(np.concatenate([ref, *(anchored[i] for i in PICKED), raw[PICKED[1]]], axis=1))  # (H, 5W, 3)
    sheet = Image.fromarray(np.concatenate(rows, axis=0))
    draw = ImageDraw.Draw(sheet)
    w = rows[0].shape[1] // 5
    for i, label in enumerate(["reference (framed)", "generated", "generated", "generated", "without the anchor"]):
        draw.text((i * w + 4, 2), label, fill=(255, 255, 255), stroke_width=2, stroke_fill=(0, 0, 0))
    sheet.save(args.out, optimize=True)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
