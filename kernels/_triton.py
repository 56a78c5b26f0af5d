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


def _to_e4m3(x, INTERPRET: tl.constexpr):
    """x (float32) -> float8e4nv, round to nearest even, saturated to +-448 (as torch's cast after a clamp).

    Compiled, the cast is the hardware's (cvt.rn.satfinite on sm_89+). Triton's interpreter rounds wrongly
    where the mantissa carries into the exponent (31.9 -> 16, seen with triton 3.6), so under INTERPRET the
    value is first rounded to the e4m3 grid in float32 (exact: the grid step is a power of two) and the
    interpreter then only casts representable values."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if INTERPRET:
        ax = tl.abs(x)
        e = ((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |x|) for normal floats
        e = tl.maximum(e, -6)  # below 2^-6: e4m3's subnormal step 2^-9
        step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e-3): 3 mantissa bits
        y = ax / step
        r = tl.floor(y + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)  # ties to even
        x = tl.where(x < 0, -r * step, r * step)
    return x.to(tl.float8e4nv)


to_e4m3: Any = triton.jit(_to_e4m3) if HAS_TRITON else None
