"""Optional Triton support shared by the kernels: import guard, interpreter mode, per-mode JIT.

Triton is an optional dependency (a GPU / dev extra), so nothing here fails when it is missing;
`HAS_TRITON` says whether it imported.

`TRITON_INTERPRET=1` (Triton's own variable, read through `triton.knobs`) runs kernels on CPU tensors in
Triton's interpreter. Triton fixes the mode of its own library functions (`tl.sum`, ...) when it is first
imported, so the variable must be set before the process's first `import triton` (anything that imports
it, `kernels` included). Our kernels are plain functions JIT-wrapped at first launch in the mode of that
moment (`jit_for_current_mode`), and `check_triton_mode` turns a mode mismatch into a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # Triton is optional: the PyTorch references are the CPU path.
    HAS_TRITON = False

_JITTED: dict[tuple[Callable[..., Any], bool], Any] = {}


def interpreter_enabled() -> bool:
    """Whether TRITON_INTERPRET is on now (False without Triton)."""
    return HAS_TRITON and bool(triton.knobs.runtime.interpret)


def check_triton_mode(where: str) -> None:
    """Raise ValueError if Triton is missing, or if the interpreter was switched on after triton's import."""
    if not HAS_TRITON:
        raise ValueError(f"{where}: Triton is not installed; install it (the dev extra) or use backend='torch'")
    if interpreter_enabled():
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.sum, InterpretedFunction):
            raise ValueError(
                f"{where}: TRITON_INTERPRET=1 was set after triton was first imported in this process; "
                "set it in the environment before anything imports triton (or kernels)"
            )


def jit_for_current_mode(fn: Callable[..., Any], **jit_kwargs: Any) -> Any:
    """`triton.jit(fn, **jit_kwargs)` in the current mode (compiled or interpreted), cached per (fn, mode)."""
    key = (fn, interpreter_enabled())
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn, **jit_kwargs)
    return _JITTED[key]


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(n - 1, 0).bit_length()
