"""The one-pass C++ AdamW's build at first use: a killed build must not leave a lock that later starts wait
on forever, checkouts with different sources must not share a build, and the build says what it is doing.

One real compile (a module fixture, in a temporary TORCH_EXTENSIONS_DIR); the other tests replace torch's
`load` with a stand-in that keeps its locking: a `lock` file in the build directory (torch's FileBaton),
created exclusively by the builder and waited on, while it exists, by everyone else."""
import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.utils.cpp_extension

from slideformer.optim import native

BUILDING = "slideformer: building the CPU optimizer (once, about 1 minute) in "
WAITING = "waiting for another process building the CPU optimizer in "


def finishes(fn, timeout):
    """fn's result, failing (not hanging) if it has not returned after `timeout` seconds."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still waiting after {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


class Killed(BaseException):
    """The build's process dying mid-compile: nothing after the kill point runs."""


class FakeTorchLoad:
    """torch.utils.cpp_extension.load as far as locking goes; torch waits on a left-over `lock` forever,
    this one for `patience` seconds before failing."""

    def __init__(self, patience=5.0):
        self.patience, self.kill_next, self.calls, self.compiles = patience, False, [], []

    def __call__(self, name, sources, extra_cflags=None, build_directory=None, verbose=False, **kw):
        directory = Path(build_directory or Path(os.environ["TORCH_EXTENSIONS_DIR"]) / name)
        directory.mkdir(parents=True, exist_ok=True)
        self.calls.append(directory)
        lock = directory / "lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            deadline = time.monotonic() + self.patience
            while lock.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited on {lock} (torch would wait forever)") from None
                time.sleep(0.05)
        else:
            if self.kill_next:
                self.kill_next = False
                os.close(fd)
                raise Killed  # the lock file stays, as after SIGKILL
            try:
                so = directory / f"{name}.so"
                if not so.exists():
                    self.compiles.append(directory)
                    so.write_bytes(b"")
            finally:
                os.close(fd)
                lock.unlink()
        return SimpleNamespace(name=name, directory=directory)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    load = FakeTorchLoad()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    return load


@contextlib.contextmanager
def holder(lock_file: Path, stale_torch_lock: bool = False):
    """Another process holding our build lock (and, if asked, torch's `lock` file, as a builder does)."""
    code = ("import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "if sys.argv[2] == '1': open(os.path.join(os.path.dirname(sys.argv[1]), 'lock'), 'w').close()\n"
            "print('locked', flush=True)\n"
            "time.sleep(600)\n")
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock_file), "1" if stale_torch_lock else "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def our_lock(tag="", flags=()):
    return native._build_directory(tag, native._FLAGS + list(flags))[1] / native._LOCK


# --- with torch's load replaced ------------------------------------------------------------------------

def test_a_lock_left_by_a_killed_build_does_not_hang(fake):
    """The issue: a build killed mid-compile leaves torch's `lock` file; the next start waited on it forever."""
    fake.kill_next = True
    with pytest.raises(Killed):
        native.build()
    (left,) = fake.calls
    assert (left / "lock").exists()
    finishes(native.build, 30)
    assert fake.compiles == [left] and not (left / "lock").exists()


def test_a_lock_held_by_a_killed_process_does_not_block(fake):
    """SIGKILL a process holding our lock mid-build: the kernel drops its flock, its torch `lock` file is stale."""
    lock_file = our_lock()
    with holder(lock_file, stale_torch_lock=True) as proc:
        with open(lock_file) as f:  # it really is held
            with pytest.raises(BlockingIOError):
                import fcntl
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (lock_file.parent / "lock").exists()
    finishes(native.build, 30)
    assert fake.compiles == [lock_file.parent] and not (lock_file.parent / "lock").exists()


def test_waits_for_a_live_builder_and_says_so_once(fake, capfd):
    lock_file = our_lock()
    result = {}
    with holder(lock_file) as proc:
        t = threading.Thread(target=lambda: result.setdefault("m", native.build()), daemon=True)
        t.start()
        err, deadline = "", time.monotonic() + 30
        while WAITING not in err and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capfd.readouterr().err
        time.sleep(0.3)
        assert t.is_alive() and not fake.calls  # blocked behind the live builder, not building alongside it
        os.kill(proc.pid, signal.SIGTERM)  # the other builder finishes
        proc.wait()
        t.join(30)
    assert not t.is_alive() and result["m"].directory == lock_file.parent
    err += capfd.readouterr().err
    assert err.count(WAITING) == 1 and f"slideformer: {WAITING}{lock_file.parent}\n" in err


def test_the_build_directory_is_keyed_by_what_the_binary_depends_on(fake, monkeypatch, tmp_path):
    """Checkouts with different sources (or flags, tag, torch) build apart; the same inputs share a build."""
    a, b, a_again = tmp_path / "a.cpp", tmp_path / "b.cpp", tmp_path / "elsewhere" / "adamw.cpp"
    a_again.parent.mkdir()
    a.write_text("// version 1\n")
    b.write_text("// version 2\n")
    a_again.write_text("// version 1\n")

    def directory(source, *args):
        monkeypatch.setattr(native, "_SOURCE", source)
        return native.build(*args).directory

    base = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    dirs = [directory(a), directory(b), directory(a_again), directory(a, "_x", ()), directory(a, "", ("-O2",))]
    assert dirs[0] != dirs[1] and dirs[0] == dirs[2]
    assert len({dirs[0], dirs[1], dirs[3], dirs[4]}) == 4
    assert all(d.parent == base and d.name.startswith("slideformer_adamw") for d in dirs)
    assert dirs[3].name.startswith("slideformer_adamw_x_")
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert directory(a) not in dirs
    assert len(fake.compiles) == 5  # a and a_again share one build


def test_says_it_is_building_only_when_it_compiles(fake, capfd):
    first = native.build()
    err = capfd.readouterr().err
    assert err == f"{BUILDING}{first.directory}\n"
    native.build()
    assert capfd.readouterr().err == ""
    assert fake.compiles == [first.directory]


def test_the_default_cache_follows_xdg_cache_home(fake, monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.build().directory.parent == tmp_path / "xdg" / "slideformer" / "extensions"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native.build().directory.parent == tmp_path / "home" / ".cache" / "slideformer" / "extensions"


def test_an_unwritable_cache_falls_back_with_a_one_line_warning(fake, monkeypatch, tmp_path):
    import warnings

    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "a_file" / "ext"))
    monkeypatch.setattr(native, "_loaded", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert native.load() is None
    (w,) = caught
    msg = str(w.message)
    assert "\n" not in msg and "using torch's fused AdamW" in msg
    assert f"cannot write the build directory {tmp_path / 'a_file' / 'ext'}" in msg and "TORCH_EXTENSIONS_DIR" in msg
    assert not fake.calls
    with pytest.raises(OSError, match="cannot write the build directory"):
        native.build()


# --- the real compile, once ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path_factory.mktemp("extensions")))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            module = native.build()
        # (not module.__file__: Python hands back a module of this name already imported from another folder)
        directory = native._build_directory("", list(native._FLAGS))[1]
        yield SimpleNamespace(module=module, stderr=err.getvalue(), directory=directory)


def test_the_real_build_says_so_then_reuses_silently(real, capfd):
    assert real.stderr.count(BUILDING) == 1 and f"{BUILDING}{real.directory}\n" in real.stderr
    assert real.directory.parent == Path(os.environ["TORCH_EXTENSIONS_DIR"])
    assert (real.directory / f"{real.directory.name}.so").is_file()
    again = native.build()
    assert hasattr(again, "adamw_step") and "building" not in capfd.readouterr().err


def test_a_torch_lock_left_in_the_real_build_directory_does_not_hang(real):
    """Before the fix torch's load slept on this file forever; the guard fails the test instead."""
    (real.directory / "lock").write_text("")
    again = finishes(native.build, 60)
    assert hasattr(again, "adamw_step") and not (real.directory / "lock").exists()


def test_a_build_of_the_same_variant_elsewhere_in_this_process_does_not_force_a_rebuild(real, capfd):
    """torch's versioner renames a second load of one name from another directory to <name>_v1 and compiles it;
    the name is already keyed by the inputs, so the cached build is loaded as it is."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER
    from torch.utils._cpp_extension_versioner import Entry

    name = real.directory.name
    JIT_EXTENSION_VERSIONER.entries[name] = Entry(0, 12345)  # as if built from another TORCH_EXTENSIONS_DIR
    again = finishes(native.build, 60)
    assert hasattr(again, "adamw_step") and (real.directory / f"{name}.so").is_file()
    assert not list(real.directory.glob("*_v*.so")) and "building" not in capfd.readouterr().err


def test_loads_of_a_finished_build_do_not_queue(real, capfd):
    """Another process loading the built module (a shared lock) does not make this one wait or say so."""
    code = ("import fcntl, os, sys, time\nfd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_SH)\n"
            "print('locked', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(real.directory / "slideformer.lock")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        again = finishes(native.build, 30)
        assert hasattr(again, "adamw_step") and WAITING not in capfd.readouterr().err
    finally:
        proc.kill()
        proc.wait()
