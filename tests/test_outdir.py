"""train/outdir.py: a run touches only what it wrote in its output folder, and resumes only its own checkpoints."""
import json
import os
import shutil
from pathlib import Path

import pytest

from slideformer.cli import main
from slideformer.train.outdir import RUN_FILE

FAST = ["train", "progress=false", "device=cpu", "micro_batch_size=4", "logging_steps=1", "max_grad_norm=null",
        "overwrite_output_dir=false"]  # (the demo's defaults start over)


def run(out, *extra):
    return main(FAST + [f"output_dir={out}", *extra])


def tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def users_folder(tmp_path):
    """The issue's folder: the user's own checkpoints and files, none written by slideformer."""
    out = tmp_path / "mine"
    for name in ("checkpoint-1", "checkpoint-500"):
        (out / name).mkdir(parents=True)
        (out / name / "weights.bin").write_bytes(b"user data " + name.encode())
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (out / "loss.png").write_bytes(b"\x89PNG user plot")
    (out / "notes.txt").write_text("my notes")
    return out


def test_the_demo_starts_over_in_its_own_folder_only(tmp_path, monkeypatch, capsys):
    """`slideformer train` twice: the demo's out/demo starts over, its metrics and TensorBoard events the last
    run's only. A folder named on the command line gets no such licence from the demo's defaults."""
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main(["train", "progress=false", "device=cpu", "max_steps=2", "logging_steps=1"]) == 0
    demo = tmp_path / "out" / "demo"
    assert [json.loads(line)["step"] for line in (demo / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert len(list((demo / "tensorboard").glob("events.out.tfevents.*"))) == 1
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["train", "progress=false", "device=cpu", "max_steps=1", "output_dir=mine"]) == 2
    assert "not written by slideformer" in capsys.readouterr().err
    # nor an out/demo of the user's own
    shutil.rmtree(demo)
    demo.mkdir()
    (demo / "metrics.jsonl").write_text('{"mine": 1}\n')
    assert main(["train", "progress=false", "device=cpu", "max_steps=1"]) == 2
    assert "not written by slideformer" in capsys.readouterr().err
    assert (demo / "metrics.jsonl").read_text() == '{"mine": 1}\n'


def test_an_output_dir_that_cannot_be_one_is_said_before_any_work(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    (tmp_path / "over" / "metrics.jsonl").mkdir(parents=True)
    # (a path within Linux's 4096 bytes whose checkpoint's files would not be)
    n = 4050 - len(str(tmp_path)) - 1
    long = tmp_path / "/".join(["d" * 199] * (n // 200) + ["d" * (n % 200 or 1)])
    assert 4096 - 96 < len(str(long)) < 4096
    for out, needle in ((tmp_path / "afile" / "sub", f"{tmp_path / 'afile'} is a file"),
                        (tmp_path / "gone", f"is a link to {tmp_path / 'missing'}, which does not exist"),
                        (tmp_path / "over", "holds a folder metrics.jsonl, where the run writes its file"),
                        (long, "is too long: a checkpoint's files there would pass")):
        assert run(out, "max_steps=1", "overwrite_output_dir=true") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "gone", "over"]


def test_what_a_run_reads_is_not_in_what_it_writes_over(tmp_path, capsys):
    """Data, a model or a chat template in the output folder's metrics.jsonl or a checkpoint: overwrite_output_dir
    would replace it (or rotation delete it) while it is read; refused before any work, untouched."""
    from slideformer.train.config import _assets

    out = tmp_path / "o"
    assert run(out, "max_steps=1") == 0
    shutil.copy(_assets() / "sample" / "alpaca.jsonl", out / "metrics.jsonl")
    (out / "checkpoint-1" / "t.jinja").write_text("{{ messages[0]['content'] }}")
    before = tree(out)
    for extra in ([f"dataset={out}/metrics.jsonl"], [f"eval_dataset={out}/./metrics.jsonl"],
                  [f"model_name_or_path={out}/checkpoint-1", f"dataset={out}/../o/metrics.jsonl"],
                  [f"chat_template={out}/checkpoint-1/t.jinja"]):
        assert run(out, "max_steps=1", "overwrite_output_dir=true", "resume_from_checkpoint=null", *extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "of output_dir" in err and "which this run writes, replaces or rotates away" \
            in err, err
        assert tree(out) == before


def test_a_folder_of_someone_elses_files_is_refused_untouched(tmp_path, capsys):
    out = users_folder(tmp_path)
    before = tree(out)
    for extra in ([], ["resume_from_checkpoint=auto"]):
        assert run(out, "max_steps=2", "save_steps=1", "save_total_limit=1", *extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not written by slideformer" in err and "overwrite_output_dir" in err
        assert tree(out) == before


def test_overwrite_output_dir_trains_there_but_deletes_nothing_of_the_users(tmp_path):
    out = users_folder(tmp_path)
    assert run(out, "max_steps=3", "save_steps=2", "save_total_limit=1", "overwrite_output_dir=true") == 0
    # rotation kept only this run's newest; the user's checkpoints are not the run's to rotate or resume
    assert (out / "checkpoint-1" / "weights.bin").read_bytes() == b"user data checkpoint-1"
    assert (out / "checkpoint-500" / "weights.bin").read_bytes() == b"user data checkpoint-500"
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "checkpoint-3" / "state" / "trainer.json").is_file() and not (out / "checkpoint-2").exists()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    # auto-resume takes this run's checkpoint-3, not the user's checkpoint-500
    assert run(out, "max_steps=4", "resume_from_checkpoint=auto") == 0
    assert (out / "checkpoint-4").is_dir() and (out / "checkpoint-500" / "weights.bin").is_file()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_the_runs_own_folder_resumes_and_a_new_run_there_is_refused(tmp_path, capsys):
    """The same command again (after a preemption) continues the run: resume_from_checkpoint is auto by
    default; a new run over its checkpoints (null) is refused with the fix."""
    out = tmp_path / "o"
    assert run(out, "max_steps=2") == 0
    run_id = json.loads((out / RUN_FILE).read_text())["run_id"]
    assert run(out, "max_steps=3", "resume_from_checkpoint=null") == 2  # a new run over this run's checkpoints
    assert "set resume_from_checkpoint: auto to continue it" in capsys.readouterr().err
    assert run(out, "max_steps=3") == 0
    assert "resumed from" in capsys.readouterr().out
    assert run(out, "max_steps=3") == 0
    assert "nothing to train: the run is already at step 3" in capsys.readouterr().out
    assert json.loads((out / RUN_FILE).read_text())["run_id"] == run_id
    meta = json.loads((out / "checkpoint-3" / "state" / "trainer.json").read_text())
    assert meta["trainer"]["run_id"] == run_id


def test_rotation_deletes_what_the_saves_wrote_and_keeps_a_file_put_in_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "o"
    assert run(out, "max_steps=1", "save_steps=1") == 0
    (out / "checkpoint-1" / "eval.txt").write_text("my eval")
    (out / "checkpoint-1" / "state" / "notes").mkdir()
    (out / "checkpoint-1" / "state" / "notes" / "n.txt").write_text("mine")
    capsys.readouterr()
    assert run(out, "max_steps=3", "save_steps=1", "save_total_limit=1") == 0
    assert capsys.readouterr().err.count("checkpoint-1 rotated out; 2 file(s) kept there, as no save wrote them") == 1
    assert tree(out / "checkpoint-1") == {"eval.txt": b"my eval", "state/notes/n.txt": b"mine"}
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-3" / "state" / "trainer.json").is_file()
    assert run(out, "max_steps=4", "save_steps=1", "save_total_limit=1") == 0  # (resumed, said nothing again)
    assert "rotated out" not in capsys.readouterr().err and (out / "checkpoint-1" / "eval.txt").is_file()


def test_rotation_keeps_a_file_edited_since_its_save_and_goes_on_where_it_cannot_remove(tmp_path, capsys,
                                                                                        monkeypatch):
    out = tmp_path / "o"
    assert run(out, "max_steps=2", "save_steps=1", "save_total_limit=null") == 0
    (out / "checkpoint-1" / "config.json").write_text('{"mine": "edited"}')
    capsys.readouterr()
    assert run(out, "max_steps=3", "save_steps=1", "save_total_limit=2") == 0
    assert "checkpoint-1 rotated out; 1 file(s) kept there, as edited since the save (config.json)" in \
        capsys.readouterr().err
    assert tree(out / "checkpoint-1") == {"config.json": b'{"mine": "edited"}'}
    # a checkpoint that cannot be removed (a file the user protected): said, and the run goes on
    import slideformer.checkpoint.state as state

    real = state.Path.unlink

    def protected(self, *a, **k):
        if self.parent.name == "checkpoint-2":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(state.Path, "unlink", protected)
    assert run(out, "max_steps=5", "save_steps=1", "save_total_limit=2") == 0
    assert "checkpoint-2 rotated out; 1 file(s) kept there, as removing it failed (Permission denied)" in \
        capsys.readouterr().err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-4",
                                                                  "checkpoint-5"]


@pytest.mark.parametrize("at", [1, 3])  # (before the run's first write, and after its first checkpoint)
def test_a_folder_removed_under_the_run_stops_it_writing_nothing_more(tmp_path, capsys, monkeypatch, at):
    from slideformer.engine import SlideEngine

    out = tmp_path / "o"
    real = SlideEngine.train_step
    steps = []

    def step_then_remove(self, *a, **k):
        steps.append(1)
        if len(steps) == at:
            shutil.rmtree(out)
        return real(self, *a, **k)

    monkeypatch.setattr(SlideEngine, "train_step", step_then_remove)
    assert run(out, "max_steps=6", "save_steps=2", "logging_steps=100") == 2
    err = capsys.readouterr().err
    assert f"output_dir {out} was removed, moved or replaced during the run" in err, err
    assert not out.exists()


def test_a_folder_in_a_saves_way_is_refused_before_training_even_with_overwrite(tmp_path, capsys):
    """overwrite_output_dir replaces checkpoints only: a checkpoint-N that is the user's folder, at a step the run
    saves, is refused up front (not after training to that step); one at a step it does not save is left be."""
    out = tmp_path / "o"
    assert run(out, "max_steps=1") == 0
    for name in ("checkpoint-3", "checkpoint-2"):
        (out / name).mkdir()
        (out / name / "notes.txt").write_text("precious")
    metrics = (out / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    for extra in ([], ["overwrite_output_dir=true"]):
        assert run(out, "max_steps=3", *extra) == 2
        err = capsys.readouterr().err
        assert "holds checkpoint-3, which is not a slideformer checkpoint, where this run would save" in err, err
        assert (out / "metrics.jsonl").read_bytes() == metrics  # (no step trained)
    (out / "checkpoint-3" / "notes.txt").rename(tmp_path / "notes.txt")
    (out / "checkpoint-3").rmdir()
    assert run(out, "max_steps=3", "overwrite_output_dir=true") == 0  # (it saves step 3 only)
    assert (out / "checkpoint-2" / "notes.txt").read_text() == "precious" and (out / "checkpoint-3").is_dir()


def test_a_checkpoint_copied_in_from_another_run_is_neither_resumed_nor_rotated(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run(a, "max_steps=5") == 0
    assert run(b, "max_steps=2", "save_steps=1", "save_total_limit=1") == 0
    shutil.copytree(a / "checkpoint-5", b / "checkpoint-5")  # another run's, by its id
    assert run(b, "max_steps=3", "save_steps=1", "save_total_limit=1", "resume_from_checkpoint=auto") == 0
    assert (b / "checkpoint-5").is_dir() and (b / "checkpoint-3").is_dir() and not (b / "checkpoint-2").exists()
    steps = [json.loads(line)["step"] for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # resumed from its own checkpoint-2, not from a's step 5


def test_auto_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, capsys):
    out = tmp_path / "o"
    assert run(out, "max_steps=2", "save_steps=1", "save_total_limit=5") == 0
    shard = out / "checkpoint-2" / "state" / "layer0.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert run(out, "max_steps=3", "save_steps=1", "save_total_limit=5", "resume_from_checkpoint=auto") == 0
    err = capsys.readouterr().err
    assert "not resuming from" in err and "checkpoint-2" in err and "corrupt" in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # resumed at 1: step 2 was trained again and logged once
    # a trainer.json edited by hand (the data position) is refused as altered
    meta_path = out / "checkpoint-3" / "state" / "trainer.json"
    meta = json.loads(meta_path.read_text())
    meta["trainer"]["offset"] += 1
    meta_path.write_text(json.dumps(meta))
    assert run(out, "max_steps=4", f"resume_from_checkpoint={out / 'checkpoint-3'}") == 2
    assert "trainer.json is corrupt or was edited" in capsys.readouterr().err


def test_a_save_that_fails_on_a_full_disk_leaves_no_partial_checkpoint(tmp_path, monkeypatch, capsys):
    import errno

    from slideformer.checkpoint import state

    out = tmp_path / "o"
    real, calls = state.save_file, {"n": 0}

    def fills_up(*a, **k):  # the second checkpoint runs out of space midway
        calls["n"] += 1
        if calls["n"] > len_units + 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **k)

    len_units = 6  # embed, 4 layers, head: the first checkpoint's files
    monkeypatch.setattr(state, "save_file", fills_up)
    assert run(out, "max_steps=4", "save_steps=2") == 5
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err
    assert "checkpoint-2 is intact" in err and "resume_from_checkpoint: auto" in err
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-2"]


def _mount_tmpfs(path, options):
    import subprocess

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")


def _umount(path):
    import subprocess

    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_real_full_disk_and_a_read_only_folder(tmp_path, capsys):
    """On a file system with room for one checkpoint: the second save fails with one line, exit 5, and
    leaves the first intact and no partial one. A read-only folder is refused the same way."""
    probe = tmp_path / "probe"
    assert run(probe, "max_steps=1") == 0
    size = sum(p.stat().st_size for p in (probe / "checkpoint-1").rglob("*") if p.is_file())
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, f"size={int(size * 1.6) + (2 << 20)}")
    try:
        capsys.readouterr()
        assert run(disk / "o", "max_steps=2", "save_steps=1", "save_total_limit=1") == 5
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "No space left on device" in err and "checkpoint-1 is intact" in err
        assert sorted(p.name for p in (disk / "o").iterdir() if p.name.startswith("checkpoint")) == ["checkpoint-1"]
        assert run(disk / "o", "max_steps=1", "resume_from_checkpoint=auto") == 0  # it resumes (nothing left to do)
    finally:
        _umount(disk)
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        assert run(ro / "o", "max_steps=1") == 5
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Read-only file system" in err and "output_dir" in err
        assert run(tmp_path / "o2", "max_steps=1", f"offload.offload_dir={ro / 'nvme'}") == 5
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Read-only file system" in err and "offload.offload_dir" in err
        assert not (tmp_path / "o2").exists()  # refused before the run took its folder
    finally:
        _umount(ro)


def test_an_offload_dir_inside_a_new_output_dir_is_the_runs_own(tmp_path, capsys, monkeypatch):
    """``output_dir: run1`` with ``offload_dir: run1/nvme``: the check that the tier's folder is writable made
    it before the run took the output folder, which was then refused as holding a folder not slideformer's
    (and left with it and a lock). Now nothing is made until the run writes there, and the tier's folders a
    run made go at its end (a run failing in its first step leaves the folder as it found it, so the same
    command runs again); a refused run (another offload_dir under a file) leaves nothing either, naming the
    file."""
    from slideformer.engine import SlideEngine

    out = tmp_path / "run1"
    tier = [f"offload.offload_dir={out / 'deep' / 'nvme'}", "offload.nvme_fraction=1"]

    def fails(self, *a, **k):
        raise RuntimeError("the machine fell over")

    monkeypatch.setattr(SlideEngine, "train_step", fails)
    assert run(out, "max_steps=1", *tier) == 1
    assert not out.exists()
    monkeypatch.undo()
    assert run(out, "max_steps=1", *tier) == 0
    assert (out / "checkpoint-1").is_dir() and not (out / "deep").exists()
    (tmp_path / "afile").write_text("mine")
    capsys.readouterr()
    assert run(tmp_path / "run2", "max_steps=1", f"offload.offload_dir={tmp_path / 'afile' / 'sub'}") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'afile'} is a file" in err
    assert not (tmp_path / "run2").exists() and (tmp_path / "afile").read_text() == "mine"


def test_a_folder_another_rank_is_taking_is_not_refused_as_foreign(tmp_path):
    """Under torchrun every rank checks the output folder, and rank 0 takes it meanwhile: a rank that looks
    while rank 0's mark is being written (its lock and the mark's temporary file there, no mark yet) sees
    a folder being taken, not one holding content that is not slideformer's (which refused that rank,
    exit 2, and its job lost it)."""
    from slideformer.train.outdir import LOCK_FILE, RUN_FILE, OutputDir

    out = tmp_path / "o"
    out.mkdir()
    (out / LOCK_FILE).write_text("")
    (out / (RUN_FILE + ".tmp")).write_text('{"run_id": "ab')
    assert OutputDir.check(out, resume="auto", overwrite=False).fresh
    # the mark renamed into place between the look for it and the listing (found by CI under load)
    os.replace(out / (RUN_FILE + ".tmp"), out / RUN_FILE)
    (out / RUN_FILE).write_text('{"run_id": "ab"}\n')
    real, looked = Path.is_file, []

    def late(self):
        if self.name == RUN_FILE and not looked:
            looked.append(self)
            return False  # (not there yet when first looked for)
        return real(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Path, "is_file", late)
        assert OutputDir.check(out, resume="auto", overwrite=False).fresh
    assert looked


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path, capsys):
    from slideformer.train.outdir import OutputDir

    held = OutputDir.check(tmp_path / "o", resume=None, overwrite=False).open()  # (as a live run holds it)
    try:
        assert run(tmp_path / "o", "max_steps=1") == 2
        assert "in use by another slideformer run" in capsys.readouterr().err
    finally:
        held.close()
    assert run(tmp_path / "o", "max_steps=1", "resume_from_checkpoint=auto") == 0


def test_a_checkpoint_of_another_run_where_this_one_will_save_is_refused(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert run(a, "max_steps=4") == 0
    assert run(b, "max_steps=2", "save_steps=2") == 0
    shutil.copytree(a / "checkpoint-4", b / "checkpoint-4")
    before = tree(b / "checkpoint-4")
    capsys.readouterr()
    assert run(b, "max_steps=4", "save_steps=2", "resume_from_checkpoint=auto") == 2
    assert "holds checkpoint-4, which this run did not write" in capsys.readouterr().err
    assert tree(b / "checkpoint-4") == before


def test_auto_resume_with_every_checkpoint_damaged_is_refused(tmp_path, capsys):
    out = tmp_path / "o"
    assert run(out, "max_steps=2", "save_steps=1", "save_total_limit=5") == 0
    for ck in out.glob("checkpoint-*"):
        (ck / "model.safetensors").write_bytes(b"junk")
    before = tree(out)
    capsys.readouterr()
    assert run(out, "max_steps=3", "resume_from_checkpoint=auto") == 2
    err = capsys.readouterr().err
    assert "no intact checkpoint of this run" in err and "2 damaged" in err
    assert tree(out) == before


def test_the_tokenizer_is_sealed_into_the_checkpoint(tmp_path):
    from slideformer.checkpoint.state import read_meta

    assert run(tmp_path / "o", "max_steps=1") == 0
    sums = read_meta(tmp_path / "o" / "checkpoint-1")["checksums"]
    assert "tokenizer.json" in sums or "tokenizer_config.json" in sums


def test_odd_names_and_bytes_in_the_folder_are_not_bugs(tmp_path):
    out = tmp_path / "o"
    assert run(out, "max_steps=1") == 0
    (out / "checkpoint-\u00b2").mkdir()  # (a digit to str.isdigit, not to int)
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\n")
    assert run(out, "max_steps=2", "resume_from_checkpoint=auto") == 0


def test_overwrite_keeps_the_users_tensorboard_files_and_a_new_run_drops_an_earlier_runs(tmp_path):
    """TensorBoard's event files are a run's only where its writer named them (``events_suffix``): a user's
    own, in a folder the run was let overwrite or beside an earlier run's files (a baseline copied in to
    compare), stay; an earlier run's go with its metrics."""
    out = tmp_path / "mine"
    (out / "tensorboard").mkdir(parents=True)
    users = out / "tensorboard" / "events.out.tfevents.1700000000.myhost.123.0"
    users.write_bytes(b"my own curves")
    assert run(out, "max_steps=1", "overwrite_output_dir=true", "report_to=tensorboard") == 0
    assert users.read_bytes() == b"my own curves"
    ours = set((out / "tensorboard").glob("events.out.tfevents.*")) - {users}
    assert len(ours) == 1
    theirs = tmp_path / "theirs"
    assert run(theirs, "max_steps=1", "report_to=tensorboard") == 0
    first = set((theirs / "tensorboard").glob("events.out.tfevents.*"))
    baseline = theirs / "tensorboard" / "events.out.tfevents.12345.mybaseline.0"
    baseline.write_bytes(b"a baseline's curves")
    assert run(theirs, "max_steps=1", "report_to=tensorboard", "overwrite_output_dir=true",
               "resume_from_checkpoint=null") == 0
    now = set((theirs / "tensorboard").glob("events.out.tfevents.*")) - {baseline}
    assert len(first) == len(now) == 1 and not first & now
    assert baseline.read_bytes() == b"a baseline's curves"


def test_a_full_disk_as_the_run_takes_its_folder_leaves_it_as_it_was(tmp_path, monkeypatch, capsys):
    """The mark's write failing (no space) leaves no half-written mark, lock or folder, so the same
    command runs once space is free."""
    import errno

    out = tmp_path / "o"
    real = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert run(out, "max_steps=1") == 5
    assert "No space left on device" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert run(out, "max_steps=1", "overwrite_output_dir=true") == 5
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    monkeypatch.setattr(os, "fsync", real)
    assert run(out, "max_steps=1", "overwrite_output_dir=true") == 0


def test_a_picture_that_cannot_be_written_does_not_hide_the_error_that_ended_the_run(tmp_path, monkeypatch, capsys):
    """The loss curve is drawn however the run ends: on a full disk its own failure is one note, and the
    checkpoint's error (naming the intact checkpoint) is the run's line and exit code."""
    import errno

    from slideformer.checkpoint import state
    from slideformer.train import loop

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    real, calls = state.save_file, {"n": 0}

    def fills_up(*a, **k):
        calls["n"] += 1
        if calls["n"] > 7:  # (the second checkpoint)
            no_space()
        return real(*a, **k)

    monkeypatch.setattr(state, "save_file", fills_up)
    monkeypatch.setattr(loop, "_draw_loss", no_space)
    out = tmp_path / "o"
    assert run(out, "max_steps=4", "save_steps=2") == 5
    err = [line for line in capsys.readouterr().err.splitlines()]
    assert any("loss.png not written" in line for line in err)
    assert "checkpoint-2 is intact" in err[-1] and "Traceback" not in "".join(err)
    assert not (out / "loss.png").exists()


def test_a_newest_checkpoint_whose_metadata_is_damaged_is_passed_over_and_never_replaced(tmp_path, capsys):
    """A checkpoint whose trainer.json was emptied cannot be told as the run's: resuming passes over it, and
    the run, which would save that step over it, is refused saying why (not "did not write"), untouched."""
    out = tmp_path / "o"
    assert run(out, "max_steps=3", "save_steps=1", "save_total_limit=5") == 0
    (out / "checkpoint-3" / "state" / "trainer.json").write_text("")
    assert run(out, "max_steps=4", "save_steps=1", "save_total_limit=5", "resume_from_checkpoint=auto") == 2
    err = capsys.readouterr().err
    assert "not resuming from" in err and "checkpoint-3" in err
    assert "holds checkpoint-3, whose metadata is damaged, so whose it is cannot be told" in err.splitlines()[-1]
    assert (out / "checkpoint-3" / "state" / "trainer.json").read_text() == ""


def test_a_run_that_ends_before_its_first_metric_removes_the_tracker_folders_it_made(tmp_path):
    """wandb's and mlflow's folders a new run made (as TensorBoard's: test_train.py) go with it when it
    fails before any metric or checkpoint: the folder would otherwise be refused to the same command again.
    One that was there before stays, with its files."""
    from slideformer.train.outdir import OutputDir

    out = tmp_path / "o"
    (out / "wandb").mkdir(parents=True)
    (out / "wandb" / "notes.txt").write_text("keep")
    run = OutputDir.check(out, resume=None, overwrite=True).open()
    for made in ("mlruns/0/meta.yaml", "tensorboard/events.out.tfevents.1", "wandb/offline-run-1/files/x"):
        (out / made).parent.mkdir(parents=True, exist_ok=True)
        (out / made).write_text("the run's")
    run.close()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == \
        ["wandb", "wandb/notes.txt", "wandb/offline-run-1", "wandb/offline-run-1/files", "wandb/offline-run-1/files/x"]


def test_rotation_after_resuming_past_a_damaged_checkpoint_keeps_the_intact_ones(tmp_path, capsys):
    """Resuming passes over a damaged newest checkpoint; the run's saves from there are its history: rotation
    keeps the newest of them (the one just saved), never the damaged later one in their place, and leaves
    that one until a save of its step replaces it."""
    from slideformer.checkpoint.state import verify_checkpoint

    out = tmp_path / "o"
    assert run(out, "max_steps=4", "save_steps=2", "save_total_limit=2") == 0
    f = out / "checkpoint-4" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    assert run(out, "max_steps=3", "save_steps=2", "save_total_limit=1", "resume_from_checkpoint=auto") == 0
    assert "not resuming from" in capsys.readouterr().err
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    verify_checkpoint(out / "checkpoint-3")
    assert run(out, "max_steps=4", "save_steps=2", "save_total_limit=1", "resume_from_checkpoint=auto") == 0
    assert "resumed from" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]
    verify_checkpoint(out / "checkpoint-4")


def test_a_new_run_over_an_earlier_one_that_fails_before_its_first_step_leaves_it_whole(tmp_path, monkeypatch,
                                                                                        capsys):
    """overwrite_output_dir starts a new run where an earlier one's checkpoints are: until the new run first
    writes (a metric or a checkpoint; a model load can take minutes, and a failure or a Ctrl-C comes there),
    the earlier run's mark, metrics and TensorBoard events stay, and the same command that made it continues
    it."""
    from slideformer.engine import SlideEngine

    out = tmp_path / "o"
    assert run(out, "max_steps=2", "save_steps=1", "report_to=tensorboard") == 0
    before = {k: v for k, v in tree(out).items() if not k.startswith("slideformer-error")}
    assert "metrics.jsonl" in before and any(k.startswith("tensorboard/") for k in before)

    def fails(self, *a, **k):
        raise RuntimeError("the machine fell over")

    monkeypatch.setattr(SlideEngine, "train_step", fails)
    assert run(out, "max_steps=2", "report_to=tensorboard", "overwrite_output_dir=true",
               "resume_from_checkpoint=null") == 1
    assert {k: v for k, v in tree(out).items() if not k.startswith("slideformer-error")} == before
    monkeypatch.undo()
    capsys.readouterr()
    assert run(out, "max_steps=3", "save_steps=1", "report_to=tensorboard", "resume_from_checkpoint=auto") == 0
    assert "resumed from" in capsys.readouterr().out and (out / "checkpoint-3").is_dir()
    # a new run's first write makes the folder its own: the earlier run's metrics and events go
    assert run(out, "max_steps=1", "report_to=tensorboard", "overwrite_output_dir=true",
               "resume_from_checkpoint=null") == 0
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert not set(before) & {k for k in tree(out) if k.startswith("tensorboard/")}


def test_another_runs_checkpoint_resumed_into_a_runs_folder_is_refused_or_a_new_run(tmp_path, capsys):
    """A checkpoint path resumes into another output_dir as a branch, a run of its own: where that folder holds
    checkpoints of its own run, the two histories would share it (its checkpoints rotated by the branch), so
    it is refused; overwrite_output_dir starts the branch there as a new run, leaving them alone."""
    a, b = tmp_path / "a", tmp_path / "b"
    assert run(a, "max_steps=2", "save_steps=1") == 0
    assert run(b, "max_steps=2", "save_steps=1", "seed=5") == 0
    before = tree(b)
    assert run(b, "max_steps=3", "save_steps=1", "save_total_limit=1", f"resume_from_checkpoint={a}/checkpoint-2") == 2
    assert "would put two histories in one folder" in capsys.readouterr().err.splitlines()[-1]
    assert tree(b) == before
    assert run(b, "max_steps=3", "save_steps=1", "save_total_limit=1", f"resume_from_checkpoint={a}/checkpoint-2",
               "overwrite_output_dir=true") == 0
    assert "resumed from" in capsys.readouterr().out
    assert sorted(p.name for p in b.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert {k: v for k, v in tree(b).items() if k.startswith(("checkpoint-1/", "checkpoint-2/"))} == \
        {k: v for k, v in before.items() if k.startswith(("checkpoint-1/", "checkpoint-2/"))}
    assert [json.loads(line)["step"] for line in (b / "metrics.jsonl").read_text().splitlines()] == [3]
    # a branch into a fresh folder, and the branch's own resume, as before
    assert run(tmp_path / "c", "max_steps=3", "save_steps=1", f"resume_from_checkpoint={a}/checkpoint-1") == 0
    assert run(tmp_path / "c", "max_steps=4", "save_steps=1") == 0
    assert "resumed from" in capsys.readouterr().out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device every write to is full)")
def test_a_full_disk_under_the_metrics_names_the_file(tmp_path):
    """A write of the metrics (an append, or the trim a resumed run makes) failing for space says which file,
    as one line, not a bare "No space left on device"."""
    from slideformer.cli import _one_line
    from slideformer.train.outdir import METRICS, OutputDir

    out = OutputDir(tmp_path, "run")
    (tmp_path / METRICS).symlink_to("/dev/full")
    with pytest.raises(OSError) as e:
        out.log({"step": 1, "loss": 2.0})
    assert _one_line(e.value) == f"error: {tmp_path / METRICS}: No space left on device; free space there or " \
                                 "choose another folder"
    (tmp_path / METRICS).unlink()
    (tmp_path / METRICS).write_text('{"step": 1}\n{"step": 2}\n')
    (tmp_path / f"{METRICS}.tmp").symlink_to("/dev/full")
    with pytest.raises(OSError) as e:
        out.trim_metrics(1)
    assert _one_line(e.value).startswith(f"error: {tmp_path / METRICS}: No space left on device")
    assert (tmp_path / METRICS).read_text() == '{"step": 1}\n{"step": 2}\n'


def test_resuming_a_run_of_another_model_is_refused_or_said(tmp_path, capsys, monkeypatch):
    """The same output_dir (a config's default) with another model: auto would continue the earlier run on its
    own weights, the named model never read; refused, naming both, before the data is read (tokenizing a large
    dataset first would make the refusal wait). A checkpoint path given resumes, said."""
    from slideformer.train import loop
    from slideformer.train.config import _assets

    out, hf = tmp_path / "o", tmp_path / "my-model"
    data = f"dataset={_assets() / 'sample' / 'alpaca.jsonl'}"
    assert run(out, "max_steps=2", "save_steps=1", data) == 0
    assert main(["export", str(out / "checkpoint-2"), str(hf)]) == 0
    before = tree(out)
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(loop, "build_examples", lambda *a, **k: pytest.fail("the data read before the refusal"))
        assert run(out, "max_steps=3", f"model_name_or_path={hf}", data) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds a run of model tiny (newest intact checkpoint-2), and this run names" in line and str(hf) in line
    assert line.endswith(f"to continue that run (its model moved), set resume_from_checkpoint: {out}/checkpoint-2")
    assert tree(out) == before
    (tmp_path / "x" / "tiny").mkdir(parents=True)  # (a folder named as the bundled model is another model)
    shutil.copytree(hf, tmp_path / "x" / "tiny", dirs_exist_ok=True)
    assert run(out, "max_steps=3", f"model_name_or_path={tmp_path / 'x' / 'tiny'}", data) == 2
    assert tree(out) == before
    assert run(out, "max_steps=3", f"model_name_or_path={hf}", data, f"resume_from_checkpoint={out}/checkpoint-2") == 0
    assert "is of a run of model tiny; this run names" in capsys.readouterr().err


def test_a_branch_with_nothing_to_train_names_its_checkpoint_and_leaves_no_folder(tmp_path, capsys):
    """A run resumed from another folder's checkpoint already at max_steps writes nothing: it says which
    checkpoint holds the run, and the new output folder is not made (or marked, so a later run there is a
    new one, not refused)."""
    assert run(tmp_path / "a", "max_steps=2") == 0
    capsys.readouterr()
    branch = tmp_path / "b"
    assert run(branch, "max_steps=2", f"resume_from_checkpoint={tmp_path / 'a' / 'checkpoint-2'}") == 0
    assert f"nothing to train: the run is already at step 2 (checkpoint: {tmp_path / 'a' / 'checkpoint-2'})" \
        in capsys.readouterr().out
    assert not branch.exists()


def test_a_run_that_finds_the_folder_taken_under_its_lock_leaves_the_others_files(tmp_path, capsys):
    """Checked while empty, then taken and trained into by another run before this one locks it: refused
    under the lock, this run removes nothing of that run's (its mark, lock file and TensorBoard folder went,
    taken for this run's as they were not there at the check: its checkpoints then no run's to resume)."""
    from slideformer.train.outdir import OutputDir, OutputDirError

    out = tmp_path / "o"
    late = OutputDir.check(out, resume=None, overwrite=False)
    assert run(out, "max_steps=1") == 0
    before = tree(out)
    with pytest.raises(OutputDirError, match="holds checkpoints of an earlier run"):
        late.open()
    assert tree(out) == before and (out / "tensorboard").is_dir()
