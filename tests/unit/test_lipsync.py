"""The lip-sync score guards every optimisation: trained weights sync the mouth to the speech far better
than random ones, and the score does not move between the write-time and naive cache paths, or between one
and two tensor-parallel ranks.

The clips are 3 held-out clips (unseen identities and sentences) cut to 3 s, shipped in data/ so no
espeak-ng is needed: `save_split([trim_clip(c, 72) for c in load_split(".cache/tiny_data/test.npz")[:3]], ...)`
after `scripts/train_tiny.py` has built the data set.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from characters.config import session_config
from characters.engine import DecoderRunner, DiTRunner
from characters.process_group import free_port, join, leave
from characters.train.data import Clip, load_split, reference_image, render_clip
from characters.train.evaluate import generate, generate_clips
from characters.train.lipsync import LipSync, lipsync_score, mouth_signal
from characters.weights import SHIPPED, resolve_weights

CLIPS = load_split(Path(__file__).parent / "data" / "lipsync_heldout.npz")
TOL = 0.02  # |r_a - r_b|: the same session on two equivalent paths differs by float rounding only


def score(clips: list[Clip], frames: list[np.ndarray]) -> LipSync:
    return lipsync_score(frames, [c.pcm for c in clips], [c.identity for c in clips],
                         [reference_image(c.identity) for c in clips])


def run(**fields: object) -> LipSync:
    cfg = session_config("tiny", "cpu", **fields)
    return score(CLIPS, generate_clips(cfg, CLIPS).frames)


@pytest.fixture(scope="module")
def trained() -> LipSync:
    return run()


@pytest.fixture(scope="module")
def untrained() -> LipSync:
    return run(weights="random")


def test_tiny_loads_its_shipped_weights_by_default() -> None:
    assert resolve_weights(session_config("tiny", "cpu")) == SHIPPED / "tiny"
    assert resolve_weights(session_config("tiny", "cpu", weights="random")) is None
    # a generation override keeps the architecture (and the weights); an architecture override has none
    assert resolve_weights(session_config("tiny", "cpu", model={"generation": {"cache_mode": "naive"}})) is not None
    assert resolve_weights(session_config("tiny", "cpu", model={"dit": {"num_layers": 2}})) is None
    total = sum(f.stat().st_size for f in (SHIPPED / "tiny").iterdir())
    assert total < 20e6, f"shipped tiny weights are {total / 1e6:.1f} MB"


def test_the_score_reads_the_mouth_from_frames_and_audio() -> None:
    clip = CLIPS[0]
    frames = render_clip(clip)
    truth = score([clip], [frames])
    assert truth.r > 0.9 and truth.offset == 0
    late = np.concatenate([np.repeat(frames[:1], 3, axis=0), frames[:-3]])  # video 3 frames behind the audio
    assert score([clip], [late]).offset == 3
    still = np.repeat(reference_image(clip.identity)[None], clip.frames, axis=0)
    assert np.allclose(mouth_signal(still, clip.identity, still[0]), 0.0)
    assert score([clip], [still]).r == 0.0


def test_trained_weights_beat_random_weights_by_a_clear_margin(trained: LipSync, untrained: LipSync) -> None:
    assert trained.r > 0.5, trained.as_dict()
    assert abs(trained.offset) <= 2, trained.as_dict()
    assert trained.r - untrained.r > 0.4, (trained.as_dict(), untrained.as_dict())


def test_score_is_unchanged_on_the_naive_cache_path(trained: LipSync) -> None:
    naive = run(model={"generation": {"cache_mode": "naive"}})
    assert abs(naive.r - trained.r) < TOL and naive.offset == trained.offset, (naive.r, trained.r)


def _rank(rank: int, ranks: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    group = join("gloo", port, rank, ranks)
    done = False
    try:
        _generate_clips(group, rank, ranks, out)  # its runners are gone when it returns
        done = True
    finally:
        del group
        released = leave(wait=done)
    assert released, f"rank {rank}: the process group outlived destroy_process_group (see characters.process_group)"


def _generate_clips(group: dist.ProcessGroup, rank: int, ranks: int, out: str) -> None:
    cfg = session_config("tiny", "cpu")
    dit = DiTRunner(cfg, group=group, rank=rank, ranks=ranks)
    decoder = DecoderRunner(cfg) if rank == 0 else None
    videos = [generate(dit, None, decoder, reference_image(c.identity), c.pcm, c.frames, seed=i)
              for i, c in enumerate(CLIPS)]
    if rank == 0:
        np.savez(out, *[v for v in videos if v is not None])




def test_score_is_unchanged_with_two_tensor_parallel_ranks(trained: LipSync, tmp_path: Path) -> None:
    out = tmp_path / "frames.npz"
    mp.spawn(_rank, args=(2, free_port(), str(out)), nprocs=2, join=True)
    with np.load(out) as z:
        tp2 = score(CLIPS, [z[f"arr_{i}"] for i in range(len(CLIPS))])
    assert abs(tp2.r - trained.r) < TOL and tp2.offset == trained.offset, (tp2.r, trained.r)
