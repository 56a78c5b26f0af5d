"""LiveAvatar's published files: which the model hub serves, how `characters weights fetch liveavatar` gets them,
and the check that a folder holds them all before anything loads.

The base (`Wan-AI/Wan2.2-S2V-14B`) and the LoRA (`Quark-Vision/Live-Avatar`) are fetched with huggingface_hub's
`snapshot_download` (only the files the model reads) and appear as one folder each under the destination, as
the authors' README lays them out (`ckpt/Wan2.2-S2V-14B/`, `ckpt/LiveAvatar/`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from characters.families.liveavatar.checkpoint import INDEX, LORA_FILE


@dataclass(frozen=True)
class HubRepo:
    repo_id: str
    folder: str  # under the destination
    patterns: tuple[str, ...]  # what to download
    required: tuple[str, ...]  # what must be there afterwards (globs)


BASE = HubRepo(
    "Wan-AI/Wan2.2-S2V-14B", "Wan2.2-S2V-14B",
    ("config.json", "diffusion_pytorch_model*.safetensors", INDEX, "Wan2.1_VAE.pth",
     "models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl/*", "wav2vec2-large-xlsr-53-english/*"),
    ("config.json", INDEX, "Wan2.1_VAE.pth", "models_t5_umt5-xxl-enc-bf16.pth", "google/umt5-xxl/*",
     "wav2vec2-large-xlsr-53-english/config.json", "wav2vec2-large-xlsr-53-english/preprocessor_config.json"),
)
LORA = HubRepo("Quark-Vision/Live-Avatar", "LiveAvatar", (LORA_FILE,), (LORA_FILE,))
REPOS = (BASE, LORA)


def missing_files(root: Path | str) -> list[str]:
    """What a fetched LiveAvatar folder lacks (paths relative to `root`): each repo's required files and every
    shard its index names. Empty when it is whole."""
    root = Path(root)
    gone: list[str] = []
    for repo in REPOS:
        base = root / repo.folder
        gone += [f"{repo.folder}/{pat}" for pat in repo.required if not any(base.glob(pat))]
    index = root / BASE.folder / INDEX
    if index.exists():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError) as err:
            return [*gone, f"{BASE.folder}/{INDEX} (unreadable: {err})"]
        gone += sorted(f"{BASE.folder}/{s}" for s in shards if not (root / BASE.folder / s).exists())
    wav = root / BASE.folder / "wav2vec2-large-xlsr-53-english"
    if wav.exists() and not any(wav.glob("*.safetensors")) and not any(wav.glob("*.bin")):
        gone.append(f"{BASE.folder}/wav2vec2-large-xlsr-53-english/(model weights)")
    return gone


def fetch(dest: Path | str, *, cache_dir: Path | str | None = None, local_files_only: bool = False,
          token: str | None = None) -> Path:
    """Download LiveAvatar's files into huggingface_hub's cache (`cache_dir`, else its default) and lay them
    out under `dest` as links to the cached snapshots (`dest/Wan2.2-S2V-14B`, `dest/LiveAvatar`): nothing is
    stored twice. `local_files_only` takes them from the cache without the network (a mirror of the hub's cache
    layout). Raises FileNotFoundError naming what is still missing."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as err:
        raise ImportError("fetching LiveAvatar needs huggingface_hub: pip install 'realtime-characters[liveavatar]'"
                          ) from err
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for repo in REPOS:
        snapshot = Path(snapshot_download(repo.repo_id, allow_patterns=list(repo.patterns), token=token,
                                          cache_dir=None if cache_dir is None else str(cache_dir),
                                          local_files_only=local_files_only))
        link = dest / repo.folder
        if link.is_symlink():
            link.unlink()
        if link.exists():
            raise FileExistsError(f"{link} exists and is not a link from an earlier fetch; move it away or fetch "
                                  "into another folder")
        link.symlink_to(snapshot, target_is_directory=True)
    gone = missing_files(dest)
    if gone:
        raise FileNotFoundError(f"LiveAvatar at {dest} is incomplete after the download: missing {gone[:6]}"
                                f"{' ...' if len(gone) > 6 else ''}; run `characters weights fetch liveavatar` again")
    return dest
