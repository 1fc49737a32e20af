"""Build (once, cached) and load the one-pass C++ AdamW through torch's extension tooling.

The build runs at first use with the machine's compiler and ``-march=native``, so the kernel uses
AVX-512 where the CPU has it and AVX2 or plain SSE otherwise. Without a working compiler the engine
falls back to torch's fused AdamW, with one warning.

Each variant builds in its own directory, ``<base>/slideformer_adamw<tag>_<hash>``, where the hash
covers everything the binary depends on (source, flags, compiler, CPU, torch and Python versions),
so checkouts with different sources never share or overwrite a build. ``<base>`` is
``TORCH_EXTENSIONS_DIR`` if set, else ``$XDG_CACHE_HOME/slideformer/extensions`` (``~/.cache``).

Concurrent builders are serialised by an ``flock`` on ``slideformer.lock`` in that directory, which
the kernel releases when its holder dies; once built, loaders take it shared and import the module
directly, so concurrent starts do not queue. Torch's own lock is a plain file that survives a killed
build and makes every later load wait forever; only the holder of our ``flock`` builds in the
directory, so a torch ``lock`` file found while holding it is stale and is removed.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("csrc") / "adamw.cpp"
# GCC contracts a*b+c into fused multiply-adds here, as torch's own vectorized AdamW does: the fp32
# path then agrees with torch.optim.AdamW(fused=True) to the last bit in the engine's parity tests.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-std=c++17"]
_LOCK = "slideformer.lock"  # ours (flock); torch's FileBaton uses "lock" in the same directory
_loaded: dict[str, object] = {}


def load(strict: bool = False):
    """The compiled module, or None (after one warning) when it cannot be built and not ``strict``."""
    if "module" in _loaded:
        return _loaded["module"]
    try:
        module = build()
    except Exception as e:  # no compiler, no headers, no ninja, no writable cache: torch's kernel still works
        if strict:
            raise
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        warnings.warn(f"slideformer: one-pass C++ AdamW unavailable ({type(e).__name__}: {reason}); "
                      "using torch's fused AdamW, which moves 40 instead of 28 bytes per parameter", stacklevel=2)
        module = None
    _loaded["module"] = module
    return module


def build(tag: str = "", flags: tuple[str, ...] = ()):
    """Compile (or reuse the cached build of) the extension; ``tag`` and ``flags`` name and shape a variant
    for the optimizer benchmark."""
    from torch.utils import cpp_extension

    cflags = _FLAGS + list(flags)
    name, directory = _build_directory(tag, cflags)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise OSError(f"cannot write the build directory {directory} ({e.strerror or e}); "
                      "set TORCH_EXTENSIONS_DIR to a writable directory") from e
    so = directory / f"{name}.so"
    if so.exists() and not (directory / "lock").exists():  # built: loaders share the lock, none waits on another
        fcntl.flock(fd, fcntl.LOCK_SH)  # (a builder holds it exclusively until its .so is whole)
        try:
            if not (directory / "lock").exists():
                module = _import(name, so)
                os.close(fd)  # (releases the lock)
                return module
        except ImportError:  # a link cut short: rebuilt below
            pass
        except BaseException:
            os.close(fd)
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
    with _exclusive(fd, directory):
        with contextlib.suppress(FileNotFoundError):
            (directory / "lock").unlink()  # left by a killed build: nobody else builds here while we hold the flock
        if not (directory / f"{name}.so").exists():
            print(f"slideformer: building the CPU optimizer (once, about 1 minute) in {directory}",
                  file=sys.stderr, flush=True)
        # The name already keys the inputs; torch's in-process versioner would also rename a second build of it
        # in another directory (another TORCH_EXTENSIONS_DIR) to <name>_v1, compiling again beside the cached one.
        getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", {}).pop(name, None)
        return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=cflags,
                                  build_directory=str(directory), verbose=False)


def default_threads() -> int:
    """Leave one core for the Python thread that drives the GPU and issues the copies; under torchrun, of
    this process's share of the host's cores (LOCAL_WORLD_SIZE processes share them)."""
    from ..machine import cores

    share = cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, share - 1)


def _build_directory(tag: str, cflags: list[str]) -> tuple[str, Path]:
    """The module name and its build directory: one per source, flags, tag, compiler, CPU, torch and Python."""
    import torch

    h = hashlib.sha256(_SOURCE.read_bytes())
    for part in (repr(cflags), tag, os.environ.get("CXX", "c++"), platform.machine(), _cpu_flags(),
                 torch.__version__, sys.version):
        h.update(b"\0" + part.encode())
    name = f"slideformer_adamw{tag}_{h.hexdigest()[:12]}"  # also the Python module name: no '-'
    return name, _base() / name


def _base() -> Path:
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "slideformer" / "extensions"


def _cpu_flags() -> str:
    """What ``-march=native`` compiles for, so a home directory shared by different CPUs keeps a build each."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _import(name: str, so: Path):
    """The built extension, loaded as torch's load would load it once built (no ninja, no torch lock)."""
    import importlib.util

    import torch  # noqa: F401  (the extension links against torch's libraries)

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


@contextlib.contextmanager
def _exclusive(fd: int, directory: Path):
    """Hold an exclusive ``flock`` on ``fd``, saying so once if another live process holds it first."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"slideformer: waiting for another process building the CPU optimizer in {directory}",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a live builder finishes; a dead one's lock is already gone
        yield
    finally:
        os.close(fd)  # releases the lock
