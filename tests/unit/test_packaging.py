"""The package builds cleanly: a wheel of the project, built as `scripts/setup.sh` builds it (setuptools from
PyPI in an isolated build environment), prints no warning (a `project.license` table once printed two
screens of deprecation notices on every setup)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_license_is_an_spdx_expression():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


def test_a_wheel_builds_without_a_warning(tmp_path):
    src = tmp_path / "src"  # a copy of what the build reads: the build's own files stay out of the checkout
    for name in ("pyproject.toml", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for pkg in ("characters", "deployments", "kernels", "placement"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("realtime_characters-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
