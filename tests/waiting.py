"""Polling helpers the test folders share (tests/conftest.py puts this folder on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(fn: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.2) -> Any:
    """Call `fn` every `every_s` until it returns something truthy (returned); fail naming `what` and the last
    value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last value {value!r}")
        time.sleep(every_s)
