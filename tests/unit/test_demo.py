"""`characters demo` end to end, as a user runs it, and its answers to bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from characters.media import read_mp4


def demo(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "characters.cli", "demo", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_demo_writes_3_seconds_of_video_with_audio(tmp_path: Path) -> None:
    out = tmp_path / "out.mp4"
    res = demo("--seconds", "3", "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    frames, fps, audio, rate = read_mp4(out)
    assert frames.shape == (72, 176, 272, 3)
    assert fps == 24
    assert abs(len(audio) / rate - 3.0) < 0.05
    assert np.abs(audio).max() > 0.05  # the bundled speech is in there, not silence
    assert frames.std() > 1.0  # not a blank picture


def test_demo_refuses_a_file_that_is_not_an_image(tmp_path: Path) -> None:
    bad = tmp_path / "face.png"
    bad.write_text("this is not a picture")
    res = demo("--image", str(bad), "--seconds", "1", "--out", str(tmp_path / "o.mp4"), cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "face.png" in res.stderr or "image" in res.stderr.lower()


def test_demo_refuses_unreadable_audio_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "speech.wav"
    bad.write_bytes(b"RIFF\x00\x00")
    res = demo("--audio", str(bad), "--seconds", "1", "--out", str(tmp_path / "o.mp4"), cwd=tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "audio" in res.stderr.lower()


def test_demo_missing_image_path_is_a_clear_error(tmp_path: Path) -> None:
    res = demo("--image", str(tmp_path / "nope.png"), "--seconds", "1", "--out", str(tmp_path / "o.mp4"), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "nope.png" in res.stderr


def test_demo_runs_with_random_weights_on_request(tmp_path: Path) -> None:
    out = tmp_path / "random.mp4"
    res = demo("--seconds", "1", "--random-weights", "--out", str(out), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert read_mp4(out)[0].shape == (24, 176, 272, 3)


def test_demo_names_a_weights_directory_that_does_not_exist(tmp_path: Path) -> None:
    res = demo("--weights", str(tmp_path / "nowhere"), "--seconds", "1", "--out", str(tmp_path / "o.mp4"), cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr and "nowhere" in res.stderr
