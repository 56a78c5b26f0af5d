"""`characters weights fetch liveavatar` through huggingface_hub's own snapshot resolution, on a local mirror in
the hub cache's layout (the hub itself cannot be reached here), and `check` naming what a folder lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from characters.commands import main

REV = "0123456789abcdef0123456789abcdef01234567"
BASE_FILES = ["config.json", "diffusion_pytorch_model-00001-of-00002.safetensors",
              "diffusion_pytorch_model-00002-of-00002.safetensors", "diffusion_pytorch_model.safetensors.index.json",
              "Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl/spiece.model",
              "google/umt5-xxl/tokenizer_config.json", "wav2vec2-large-xlsr-53-english/config.json",
              "wav2vec2-large-xlsr-53-english/preprocessor_config.json",
              "wav2vec2-large-xlsr-53-english/model.safetensors", "README.md"]


def _mirror(cache: Path, repo: str, files: list[str]) -> Path:
    """A repo in huggingface_hub's cache layout: refs/main -> a snapshot folder of files."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REV)
    snap = root / "snapshots" / REV
    for name in files:
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).write_bytes(b"x")
    index = snap / "diffusion_pytorch_model.safetensors.index.json"
    if index.exists():
        index.write_text(json.dumps({"weight_map": {"a": "diffusion_pytorch_model-00001-of-00002.safetensors",
                                                    "b": "diffusion_pytorch_model-00002-of-00002.safetensors"}}))
    return snap


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    cache = tmp_path / "hub"
    _mirror(cache, "Wan-AI/Wan2.2-S2V-14B", BASE_FILES)
    _mirror(cache, "Quark-Vision/Live-Avatar", ["liveavatar.safetensors"])
    return cache


def test_fetch_lays_out_the_snapshots_and_check_passes(cache: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "ckpt"
    assert main(["weights", "fetch", "liveavatar", "--offline", "--cache-dir", str(cache), "--dest", str(dest)]) == 0
    base = dest / "Wan2.2-S2V-14B"
    assert base.is_symlink() and (base / "Wan2.1_VAE.pth").read_bytes() == b"x"
    assert (dest / "LiveAvatar" / "liveavatar.safetensors").exists()
    assert main(["weights", "check", "liveavatar", "--dest", str(dest)]) == 0
    # a second fetch replaces its own links
    assert main(["weights", "fetch", "liveavatar", "--offline", "--cache-dir", str(cache), "--dest", str(dest)]) == 0
    assert "LiveAvatar is in" in capsys.readouterr().out


def test_a_missing_shard_is_named(cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snap = cache / "models--Wan-AI--Wan2.2-S2V-14B" / "snapshots" / REV
    (snap / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    code = main(["weights", "fetch", "liveavatar", "--offline", "--cache-dir", str(cache),
                 "--dest", str(tmp_path / "ckpt")])
    assert code == 2
    assert "Wan2.2-S2V-14B/diffusion_pytorch_model-00002-of-00002.safetensors" in capsys.readouterr().err


def test_check_names_what_an_empty_folder_lacks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["weights", "check", "liveavatar", "--dest", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Wan2.2-S2V-14B/diffusion_pytorch_model.safetensors.index.json" in err
    assert "LiveAvatar/liveavatar.safetensors" in err


def test_offline_without_the_repo_in_the_cache_fails_cleanly(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["weights", "fetch", "liveavatar", "--offline", "--cache-dir", str(tmp_path / "empty"),
                 "--dest", str(tmp_path / "ckpt")]) == 2
    assert "characters weights:" in capsys.readouterr().err
