"""What the golden scripts share: importing the authors' modules from a checkout without their package
`__init__` files (which pull in pipelines the model parts do not use), and our synthetic weights by path (plain
torch, so a GPU machine without the project's environment runs the oracle too)."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
AUTHORS_COMMIT = "9c2c38de1715e553127b42c82cb959f756b02595"  # the checkout the goldens were made from
# their packages whose __init__ files import pipelines (T5, VAE, wav2vec, decord, sam2) the model parts do not use
BYPASSED_PACKAGES = ("liveavatar", "liveavatar.models", "liveavatar.models.wan", "liveavatar.models.wan.wan_2_2",
                     "liveavatar.models.wan.wan_2_2.modules", "liveavatar.models.wan.wan_2_2.modules.s2v",
                     "liveavatar.utils")


def register_packages(root: Path, packages: Sequence[str] = BYPASSED_PACKAGES) -> None:
    """Put `root` on sys.path and register each package as an empty module whose __path__ is its real folder."""
    sys.path.insert(0, str(root))
    for name in packages:
        package = types.ModuleType(name)
        package.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = package
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], leaf, package)


def load_synthetic() -> types.ModuleType:
    """`characters/families/liveavatar/synthetic.py`, loaded by path."""
    path = ROOT / "characters" / "families" / "liveavatar" / "synthetic.py"
    spec = importlib.util.spec_from_file_location("liveavatar_synthetic", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def provenance(authors: Path, stated_commit: str, **versions: str) -> dict[str, str]:
    """Where golden tensors come from: the authors' commit (read from git, else the one stated), the exact
    command, the date, and the versions of what ran them."""
    import os
    import platform
    import shlex
    import subprocess
    import time

    try:
        commit = subprocess.run(["git", "-C", str(authors), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = f"{stated_commit} (stated; {authors} is not a git checkout)"
    env = f"PYTHONPATH={shlex.quote(os.environ['PYTHONPATH'])} " if os.environ.get("PYTHONPATH") else ""
    return {"authors": "Alibaba-Quark/LiveAvatar", "authors_commit": commit,
            "command": env + shlex.join([os.path.relpath(sys.executable), *sys.argv]),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **versions,
            "python": platform.python_version(), "machine": platform.machine()}
