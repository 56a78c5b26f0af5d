"""scripts/benchmarks/bench_latency.py: when the viewer heard an utterance's sample 0 is found by matching what it
received against the utterance, not by the first loud frame (an utterance that starts quietly would add the
quiet part to the latency). Pure CPU, no marker."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from characters.audio import SAMPLE_AUDIO, load_audio

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_latency", REPO / "scripts" / "benchmarks" / "bench_latency.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_latency"] = module
    spec.loader.exec_module(module)
    return module


bench = _load()
SR = bench.SR


def utterance(start_s: float = 1.0) -> np.ndarray:
    """1 s of the shipped speech, starting with 12 ms of exact zeros and a 60 ms fade-in (as espeak-ng's do)."""
    a = int(start_s * SR)
    pcm = load_audio(SAMPLE_AUDIO, SR)[a: a + SR].astype(np.float64)  # a voiced second of it
    pcm[: int(0.012 * SR)] = 0.0
    ramp = int(0.06 * SR)
    pcm[:ramp] *= np.linspace(0.0, 1.0, ramp) ** 2
    return np.clip(np.rint(pcm / max(1e-9, np.abs(pcm).max()) * 0.5 * 32767), -32768, 32767).astype(np.int16)


def received(utt: np.ndarray, sample0_at: float, lead_s: float, noise: float, seed: int = 0) -> tuple[
        list[float], list[np.ndarray]]:
    """The viewer's 10 ms frames: `lead_s` of near-silence, then the utterance (low-passed and noisy: a codec's
    damage), stamped so that sample 0 arrives at `sample0_at`; the frame grid is not the utterance's."""
    rng = np.random.default_rng(seed)
    x = np.convolve(utt.astype(np.float64), np.ones(3) / 3, mode="same")  # a gentle low-pass
    lead = int(lead_s * SR) + 37  # off the 10 ms grid
    stream = np.concatenate([np.zeros(lead), x, np.zeros(SR // 5)])
    stream += rng.normal(0, noise * 32767, stream.size)
    pcm = np.clip(np.rint(stream), -32768, 32767).astype(np.int16)
    n = SR // 100
    frames = [pcm[i: i + n] for i in range(0, pcm.size - n + 1, n)]
    t_start = sample0_at - lead / SR
    return [t_start + k * n / SR for k in range(len(frames))], frames


@pytest.mark.parametrize("noise", [0.0, 0.003])
def test_sample0_is_found_where_the_level_threshold_is_late(noise: float) -> None:
    utt = utterance()
    times, frames = received(utt, sample0_at=10.0, lead_s=0.3, noise=noise)
    rms = [float(np.sqrt(np.mean((f.astype(np.float64) / 32768) ** 2))) for f in frames]
    level = bench.onset(times, rms, 9.0, 0.01)
    assert level is not None and level - 10.0 > 0.015  # the first loud frame comes well after sample 0
    got = bench.heard_sample0(times, frames, utt, level)
    assert got is not None
    at, match = got
    assert abs(at - 10.0) < 1.5e-3, at  # within 24 samples of the truth
    assert match > 0.8


def test_no_match_when_the_utterance_never_arrived() -> None:
    utt = utterance()
    other = utterance(3.1)  # other words
    times, frames = received(other, sample0_at=10.0, lead_s=0.3, noise=0.003, seed=1)
    assert bench.heard_sample0(times, frames, utt, 10.05) is None
    assert bench.heard_sample0([], [], utt, 10.0) is None
