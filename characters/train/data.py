"""The procedural data set: one cartoon identity speaking one espeak-ng utterance per clip.

A clip is its identity, its utterance, 16 kHz PCM (silence before and after the speech) and the per-frame
motion the renderer draws (mouth opening, head dy); the frames themselves are rendered on demand
(`render_clip`, ~1 ms a frame), so a data set of hundreds of clips is a few MB of PCM and JSON.
Clips have a whole number of chunks (4 frames) at 24 fps. Splits are seeded: `build_split("train")` and
`build_split("test")` draw disjoint seeds, so test identities are unseen, and test sentences that occur in
the training split are drawn again, so test sentences are unseen too.

On disk (`save_split` / `load_split`): `<dir>/<split>.npz` holding `pcm` (int16, all clips end to end),
`offsets` (sample offsets), `mouth` / `dy` (float32, all frames end to end), `frame_offsets`, and
`meta` (JSON: identities and utterances).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from characters.audio import SAMPLE_RATE
from characters.train.face import Identity, Pose, render, sample_identity
from characters.train.speech import FPS, Utterance, motion_tracks, sample_utterance, synthesize

Split = Literal["train", "test"]
FRAMES_PER_CHUNK = 4
# the recipe's split sizes (scripts/tools/train_tiny.py, scripts/benchmarks/eval_lipsync.py)
TRAIN_CLIPS, TEST_CLIPS = 240, 51
_SEEDS = {"train": 1_000, "test": 2_000_000}


@dataclass
class Clip:
    identity: Identity
    utterance: Utterance
    pcm: np.ndarray  # (samples,) float32 mono 16 kHz; samples == frames * 16000 / 24 rounded down
    mouth: np.ndarray  # (F,) opening in [0, 1]
    dy: np.ndarray  # (F,) head offset in pixels

    @property
    def frames(self) -> int:
        return int(self.mouth.shape[0])


def clip_samples(frames: int) -> int:
    return frames * SAMPLE_RATE // FPS


def make_clip(identity: Identity, utt: Utterance, rng: np.random.Generator) -> Clip:
    """Synthesize `utt`, pad it with 0.2-0.7 s of silence each side to whole chunks, derive its motion."""
    speech = synthesize(utt)
    lead = int(rng.uniform(0.2, 0.7) * SAMPLE_RATE)
    tail = int(rng.uniform(0.2, 0.7) * SAMPLE_RATE)
    total = lead + speech.size + tail
    frames = -(-total * FPS // SAMPLE_RATE)
    frames = -(-frames // FRAMES_PER_CHUNK) * FRAMES_PER_CHUNK
    pcm = np.zeros(clip_samples(frames), np.float32)
    pcm[lead:lead + speech.size] = speech[: pcm.size - lead]
    mouth, dy = motion_tracks(pcm, frames)
    return Clip(identity, utt, pcm, mouth.astype(np.float32), dy.astype(np.float32))


def build_split(split: Split, n: int, *, exclude_texts: set[str] | None = None, seed: int = 0) -> list[Clip]:
    """`n` clips of `split`: a fresh identity and utterance for each, reproducible from `seed`."""
    rng = np.random.default_rng(_SEEDS[split] + seed)
    clips = []
    for _ in range(n):
        identity = sample_identity(rng)
        utt = sample_utterance(rng)
        while exclude_texts and utt.text in exclude_texts:
            utt = sample_utterance(rng)
        clips.append(make_clip(identity, utt, rng))
    return clips


def trim_clip(clip: Clip, frames: int) -> Clip:
    """The clip's first `frames` frames (a multiple of 4) and their samples."""
    frames = min(frames, clip.frames) // FRAMES_PER_CHUNK * FRAMES_PER_CHUNK
    return Clip(clip.identity, clip.utterance, clip.pcm[: clip_samples(frames)], clip.mouth[:frames], clip.dy[:frames])


def reference_image(identity: Identity) -> np.ndarray:
    """The identity at rest (mouth closed, head centred): what a session starts from. (H, W, 3) uint8"""
    return render(identity, Pose())


def render_clip(clip: Clip, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Frames [start, stop) of a clip. (F, H, W, 3) uint8"""
    stop = clip.frames if stop is None else stop
    return np.stack([render(clip.identity, Pose(float(clip.mouth[f]), 0.0, float(clip.dy[f])))
                     for f in range(start, stop)])


def save_split(clips: list[Clip], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = [{"identity": c.identity.to_json(), "utterance": asdict(c.utterance)} for c in clips]
    np.savez_compressed(
        path,
        pcm=np.concatenate([np.round(c.pcm * 32767).astype(np.int16) for c in clips]),
        offsets=np.cumsum([0] + [c.pcm.size for c in clips]),
        mouth=np.concatenate([c.mouth for c in clips]),
        dy=np.concatenate([c.dy for c in clips]),
        frame_offsets=np.cumsum([0] + [c.frames for c in clips]),
        meta=np.array(json.dumps(meta)),
    )


def load_split(path: str | Path) -> list[Clip]:
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        pcm, off, fo = z["pcm"], z["offsets"], z["frame_offsets"]
        mouth, dy = z["mouth"], z["dy"]
    return [Clip(Identity.from_json(m["identity"]), Utterance(**m["utterance"]),
                 pcm[off[i]:off[i + 1]].astype(np.float32) / 32767, mouth[fo[i]:fo[i + 1]], dy[fo[i]:fo[i + 1]])
            for i, m in enumerate(meta)]


def load_or_build(directory: str | Path, train_clips: int, test_clips: int,
                  log: bool = True) -> tuple[list[Clip], list[Clip]]:
    """The cached splits in `directory`, built (and saved) first if missing or of another size."""
    directory = Path(directory)
    out: dict[str, list[Clip]] = {}
    for split, n in (("train", train_clips), ("test", test_clips)):
        path = directory / f"{split}.npz"
        if path.is_file():
            clips = load_split(path)
            if len(clips) == n:
                out[split] = clips
                continue
        if log:
            print(f"building the {split} split: {n} clips -> {path}", flush=True)
        exclude = {c.utterance.text for c in out.get("train", [])} if split == "test" else None
        out[split] = build_split(split, n, exclude_texts=exclude)  # type: ignore[arg-type]
        save_split(out[split], path)
    return out["train"], out["test"]
