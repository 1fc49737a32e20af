"""Training-state checkpoints: resume is bit-identical; corruption and interrupted saves are detected."""
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from slideformer import SlideEngine
from slideformer.checkpoint.state import CorruptCheckpointError

from tiny import batch, build, engine_config, kill_during_second_save

CPU = dict(device="cpu", compute_dtype=torch.float32, lr=1e-2, weight_decay=0.1)


def run(model, steps, start=0, resume=None, save=None, save_at=None, **cfg):
    eng = SlideEngine(model, engine_config(**{**CPU, **cfg}))
    with eng:
        if resume:
            assert eng.load_checkpoint(resume)["next"] == start
        for k in range(start, steps):
            eng.train_step(batch(97, seed=k))
            if save and k + 1 == save_at:
                eng.save_checkpoint(save, {"next": k + 1})
        return {k: v.clone() for k, v in eng.state_dict().items()}


@pytest.mark.parametrize("cfg", [{}, {"max_grad_norm": 0.05}, {"host_grad_buffers": 1},
                                 {"compute_dtype": torch.bfloat16, "host_weights": 1},  # a bf16 copy for all but one layer
                                 # units trained on the device: their state is saved from and restored to it
                                 {"resident_layers": 1, "resident_edges": True, "max_grad_norm": 0.05},
                                 {"resident_layers": 1, "compute_dtype": torch.bfloat16, "optimizer_state": "compact"}])
def test_resume_is_bit_identical(tmp_path, cfg):
    model = build("qwen2-tied")
    straight = run(model, 6, **cfg)
    run(model, 3, save=tmp_path / "ck", save_at=3, **cfg)
    resumed = run(model, 6, start=3, resume=tmp_path / "ck", **cfg)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_checkpoint_loads_in_transformers(tmp_path):
    model = build("llama")
    run(model, 2, save=tmp_path / "ck", save_at=2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ck")
    assert loaded.generate(torch.tensor([[1, 2]]), max_new_tokens=3, do_sample=False).shape == (1, 5)


def test_corruption_is_detected(tmp_path):
    model = build("llama")
    run(model, 1, save=tmp_path / "ck", save_at=1)
    f = tmp_path / "ck" / "state" / "layer1.safetensors"  # one unit's master and moments
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="layer1.safetensors is corrupt"):
        run(model, 2, start=1, resume=tmp_path / "ck")
    (tmp_path / "ck" / "state" / "trainer.json").unlink()
    with pytest.raises(CorruptCheckpointError, match="not a complete slideformer checkpoint"):
        run(model, 2, start=1, resume=tmp_path / "ck")


def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path):
    """A child saves once, then is killed in the middle of its second save (while writing its files)."""
    kill_during_second_save(tmp_path / "ck", CPU, 1)
    assert (tmp_path / "ck.tmp").exists()  # the interrupted save
    model = build("llama")
    eng = SlideEngine(model, engine_config(**CPU))
    with eng:
        assert eng.load_checkpoint(tmp_path / "ck")["next"] == 1  # the previous one, intact
        assert eng.store.step == 1


def test_full_disk_gives_a_clear_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    import errno

    from slideformer.checkpoint import state

    model = build("llama")
    eng = SlideEngine(model, engine_config(**CPU))
    with eng:
        eng.train_step(batch(97))
        eng.save_checkpoint(tmp_path / "ck", {"next": 1})
        eng.train_step(batch(97, seed=1))

        from safetensors import SafetensorError

        for error in (OSError(errno.ENOSPC, "No space left on device"),  # as safetensors reports a full disk:
                      SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")):
            def full(*a, **k):
                raise error

            monkeypatch.setattr(state, "save_file", full)
            with pytest.raises(state.CheckpointWriteError, match="No space left on device.*existing checkpoints are "
                                                                 "untouched") as info:
                eng.save_checkpoint(tmp_path / "ck", {"next": 2})
            assert info.value.errno == errno.ENOSPC
            assert not (tmp_path / "ck.tmp").exists()
            monkeypatch.undo()
        assert eng.load_checkpoint(tmp_path / "ck")["next"] == 1


@pytest.mark.parametrize("state,other", [("compact", "8bit"), ("8bit", "fp32")])
def test_compact_state_resumes_bit_identically(tmp_path, state, other):
    model = build("llama")
    kw = dict(compute_dtype=torch.bfloat16, optimizer_state=state)
    straight = run(model, 4, **kw)
    run(model, 2, save=tmp_path / "ck", save_at=2, **kw)
    resumed = run(model, 4, start=2, resume=tmp_path / "ck", **kw)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    with pytest.raises(CorruptCheckpointError, match=f"saved with optimizer_state={state}, this run has {other}; "
                                                     f"resume with optimizer_state={state}"):
        run(model, 3, start=2, resume=tmp_path / "ck", compute_dtype=torch.bfloat16, optimizer_state=other)


def test_a_save_over_its_own_checkpoint_keeps_the_files_no_save_wrote(tmp_path, capsys):
    """A checkpoint saved again under its name: the old save's files go, a file put in it by hand stays (set
    aside with the old folder, said on stderr); later saves of that name neither refuse nor touch it."""
    eng = SlideEngine(build("llama"), engine_config(**CPU))
    ck, old = tmp_path / "ck", tmp_path / "ck.old"
    with eng:
        eng.train_step(batch(97))
        eng.save_checkpoint(ck, {"next": 1})
        (ck / "state" / "notes.txt").write_text("mine")
        eng.save_checkpoint(ck, {"next": 1})
        assert "1 file(s) of the old one kept in" in capsys.readouterr().err
        assert [p.relative_to(old).as_posix() for p in old.rglob("*") if p.is_file()] == ["state/notes.txt"]
        for _ in range(2):
            eng.save_checkpoint(ck, {"next": 1})
            assert "kept in" not in capsys.readouterr().err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.old"]
        assert (old / "state" / "notes.txt").read_text() == "mine" and eng.load_checkpoint(ck)["next"] == 1
        shutil.rmtree(old)
        shutil.copytree(ck, old)  # (the user's backup under the aside's name: a save never takes it for its own)
        eng.save_checkpoint(ck, {"next": 1})
        assert eng.load_checkpoint(old)["next"] == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["ck", "ck.old"]


def test_a_removal_cut_short_is_finished_by_the_next(tmp_path, monkeypatch):
    """The metadata goes last: a checkpoint whose removal was killed midway still says what its save wrote."""
    from pathlib import Path

    from slideformer.checkpoint.state import read_meta, remove_checkpoint

    eng = SlideEngine(build("llama"), engine_config(**CPU))
    with eng:
        eng.train_step(batch(97))
        eng.save_checkpoint(tmp_path / "ck", {"next": 1})
    written = len(read_meta(tmp_path / "ck")["checksums"])
    real, calls = Path.unlink, []

    def killed(self, *a, **k):
        if len(calls) == 2:
            raise KeyboardInterrupt  # (as a signal would, mid-removal)
        calls.append(self)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "unlink", killed)
    with pytest.raises(KeyboardInterrupt):
        remove_checkpoint(tmp_path / "ck")
    monkeypatch.undo()
    assert written > 3 and len(read_meta(tmp_path / "ck")["checksums"]) == written
    assert remove_checkpoint(tmp_path / "ck") == ([], "no save wrote them") and not (tmp_path / "ck").exists()


def test_a_removal_never_reaches_through_a_link(tmp_path):
    """A checkpoint whose state/ is a link to another's: its own files go, the other's (metadata too) stay."""
    from slideformer.checkpoint.state import remove_checkpoint, verify_checkpoint

    eng = SlideEngine(build("llama"), engine_config(**CPU))
    with eng:
        eng.train_step(batch(97))
        eng.save_checkpoint(tmp_path / "a", {"next": 1})
        eng.save_checkpoint(tmp_path / "b", {"next": 1})
    shutil.rmtree(tmp_path / "b" / "state")
    (tmp_path / "b" / "state").symlink_to(tmp_path / "a" / "state")
    kept, _ = remove_checkpoint(tmp_path / "b")
    assert kept == [tmp_path / "b" / "state"] and verify_checkpoint(tmp_path / "a")["step"] == 1


def test_a_refused_save_leaves_the_users_tmp_folder(tmp_path):
    """A save refused because ``<path>.tmp`` is the user's folder removes nothing: only a copy it made goes."""
    from slideformer.checkpoint.loader import CheckpointError

    (tmp_path / "ck.tmp").mkdir()
    (tmp_path / "ck.tmp" / "thesis.txt").write_text("mine")
    eng = SlideEngine(build("llama"), engine_config(**CPU))
    with eng:
        eng.train_step(batch(97))
        with pytest.raises(CheckpointError, match="ck.tmp exists and is not a slideformer checkpoint"):
            eng.save_checkpoint(tmp_path / "ck", {"next": 1})
    assert (tmp_path / "ck.tmp" / "thesis.txt").read_text() == "mine" and not (tmp_path / "ck").exists()


def test_an_interrupted_save_is_told_by_its_mark_and_removed_by_the_next(tmp_path):
    """A save marks its folder first and unmarks it once sealed (the metadata says so then, and the mark is
    no file of the checkpoint's: a copy without hidden files verifies). An interrupted save's folder, or
    what a removal cut short left of one (the mark goes last), is removed by the next save; a folder without
    the mark or metadata is the user's."""
    from slideformer.checkpoint.state import MARK, is_checkpoint_dir, verify_checkpoint

    with SlideEngine(build("llama"), engine_config(**CPU)) as eng:
        eng.train_step(batch(97))
        eng.save_checkpoint(tmp_path / "ck", {"next": 1})
        assert not (tmp_path / "ck" / "state" / MARK).exists()
        assert not any(MARK in k for k in verify_checkpoint(tmp_path / "ck")["checksums"])
        for left in (["state/layer0.safetensors", "model.safetensors", "tokenizer/vocab.json"], []):
            tmp = tmp_path / "ck.tmp"
            (tmp / "state").mkdir(parents=True)
            (tmp / "state" / MARK).touch()
            for rel in left:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(b"partial")
            assert is_checkpoint_dir(tmp)
            eng.save_checkpoint(tmp_path / "ck", {"next": 1})
            assert not tmp.exists() and verify_checkpoint(tmp_path / "ck")["step"] == 1
        (tmp_path / "ck.tmp" / "state").mkdir(parents=True)
        assert not is_checkpoint_dir(tmp_path / "ck.tmp")
