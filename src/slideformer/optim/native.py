"""Build (once, cached) and load the one-pass C++ AdamW through torch's extension tooling.

The build runs at first use with the machine's compiler and ``-march=native``, so the kernel uses
AVX-512 where the CPU has it and AVX2 or plain SSE otherwise; torch caches the result under
``TORCH_EXTENSIONS_DIR`` and rebuilds only when the source changes. Without a working compiler the
engine falls back to torch's fused AdamW, with one warning.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("csrc") / "adamw.cpp"
# GCC contracts a*b+c into fused multiply-adds here, as torch's own vectorized AdamW does: the fp32
# path then agrees with torch.optim.AdamW(fused=True) to the last bit in the engine's parity tests.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-std=c++17"]
_loaded: dict[str, object] = {}


def load(strict: bool = False):
    """The compiled module, or None (after one warning) when it cannot be built and not ``strict``."""
    if "module" in _loaded:
        return _loaded["module"]
    try:
        module = build()
    except Exception as e:  # no compiler, no headers, no ninja: torch's kernel still works
        if strict:
            raise
        warnings.warn(f"slideformer: one-pass C++ AdamW unavailable ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                      "using torch's fused AdamW, which moves 40 instead of 28 bytes per parameter", stacklevel=2)
        module = None
    _loaded["module"] = module
    return module


def build(tag: str = "", flags: tuple[str, ...] = ()):
    """Compile (or fetch from torch's cache) the extension; ``tag`` and ``flags`` name and shape a variant
    for the optimizer benchmark."""
    from torch.utils.cpp_extension import load as torch_load

    return torch_load(name="slideformer_adamw" + tag, sources=[str(_SOURCE)], extra_cflags=_FLAGS + list(flags),
                      verbose=False)


def default_threads() -> int:
    """Leave one core for the Python thread that drives the GPU and issues the copies."""
    return max(1, (os.cpu_count() or 2) - 1)
