"""Running a test module's Triton kernel tests under Triton's interpreter, in a child process: TRITON_INTERPRET must be
set before triton's first import, and pytest imports `kernels` (hence triton) compiled in this one (tests/conftest.py
puts this folder on sys.path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels._triton import HAS_TRITON


def run_interpreted(test_file: str, *, passed: int, at_least: bool = False, k: str | None = None) -> None:
    """Run `test_file` (a module's `__file__`) under `TRITON_INTERPRET=1` in a child pytest (only the tests matching
    `k`, if given) and assert it ran `passed` tests (at least that many with `at_least`), none failed or skipped."""
    if not HAS_TRITON:
        pytest.fail("Triton is a dev dependency: install the dev extra")
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", str(Path(test_file).resolve()), "-q", "-p", "no:cacheprovider",
           *(["-k", k] if k else [])]
    res = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=root, capture_output=True, text=True,
                         timeout=300)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    summary = re.search(r"(\d+) passed", res.stdout)
    assert summary, tail
    count = int(summary.group(1))
    assert count >= passed if at_least else count == passed, tail
    assert not re.search(r"\d+ (failed|skipped|error)", res.stdout), tail
