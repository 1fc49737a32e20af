"""The training product: config validation, resume at the exact sample, interrupts, NaN, skipping."""
import json
import math
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load_file

from slideformer import EngineConfig
from slideformer.cli import main
from slideformer.model import ModelAdapter
from slideformer.config import ConfigError
from slideformer.data import DataError
from slideformer.train.config import load_config
from slideformer.train.loop import train

FAST = ["progress=false", "device=cpu", "micro_batch_size=4", "logging_steps=1", "max_grad_norm=null"]


def cfg(tmp_path, *extra):
    return load_config(None, FAST + [f"output_dir={tmp_path}"] + list(extra))


def master(path):
    return {f.stem: load_file(str(f))["master"] for f in (path / "state").glob("*.safetensors")}


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        load_config(None, ["learnig_rate=1e-4"])
    with pytest.raises(ConfigError, match="offload.gpu_memory_limt; did you mean 'gpu_memory_limit'"):
        load_config(None, ["offload.gpu_memory_limt=24GiB"])


def test_a_config_from_another_trainer_is_told_every_key_at_once(tmp_path):
    """A LLaMA-Factory config brought over: each of its keys slideformer has not is named in one line, with
    what slideformer does instead (or a did-you-mean), not one per run."""
    (tmp_path / "lf.yaml").write_text("model_name_or_path: tiny\nstage: sft\ndo_train: true\nfinetuning_type: full\n"
                                      "template: qwen\nsplit: train\nflash_attn: fa2\nmax_samples: 100\n"
                                      "per_device_train_batch_size: 2\nlearning_rate: 1.0e-5\nlerning: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "lf.yaml", [])
    line = str(e.value)
    assert "\n" not in line and "max_samples" not in line  # (a key of its own: max_samples)
    assert line.startswith("unknown keys stage (slideformer fine-tunes (sft) only: remove it); ")
    for part in ("do_train (remove it)", "finetuning_type (every parameter trains: remove it)",
                 "template (the tokenizer's chat template renders chats", "per_device_train_batch_size (use "
                 "micro_batch_size)", "lerning (did you mean 'learning_rate'?)",
                 "split (a dataset entry's: dataset=[{path: ..., split: ...}])",
                 "flash_attn (use attn_implementation (sdpa, eager, flash_attention_2 or flash_attention_3))"):
        assert part in line, line


def test_yaml_with_overrides(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    (tmp_path / "c.yaml").write_text("model_name_or_path: tiny\ndataset:\n  - {path: d.jsonl, format: text}\nlearning_rate: 1.0e-4\n"
                                     "offload:\n  window_slots: 2\n")
    c = load_config(tmp_path / "c.yaml", ["learning_rate=2e-4", "offload.prefetch_depth=1"])
    assert c.learning_rate == 2e-4 and c.offload.window_slots == 2
    assert c.dataset[0].path == str(tmp_path / "d.jsonl")


@pytest.mark.parametrize("bad,match", [("lr_scheduler_type=step", "lr_scheduler_type"),
                                       ("warmup_ratio=1.5", "warmup_ratio"), ("micro_batch_size=0", "micro_batch_size"),
                                       ("offload.host_grad_buffers=0", "host_grad_buffers must be auto, null or"),
                                       ("attn_implementation=flash", "attn_implementation must be one of sdpa"),
                                       ("warmup_steps=2.5", "warmup_steps must be a number of steps"),
                                       ("warmup_steps=-1", "warmup_steps must be"),
                                       ("adam_epsilon=0", "adam_epsilon must be > 0"),
                                       ("adam_epsilon=inf", "adam_epsilon must be a finite number")])
def test_conflicts_name_the_fix(bad, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [bad])


def test_packing_under_flash_attention_is_one_row_a_micro_batch():
    with pytest.raises(ConfigError, match="flash attention keeps packed samples apart only in a micro-batch of one "
                                          r"row .*micro_batch_size: 1 \(now 4"):
        load_config(None, ["packing=true", "attn_implementation=flash_attention_3", "micro_batch_size=4"])
    load_config(None, ["packing=true", "attn_implementation=flash_attention_3", "micro_batch_size=1"])
    load_config(None, ["packing=true", "micro_batch_size=4"])


@pytest.mark.parametrize("accum,extra", [(1, []), (2, []),
                                         # units trained on the device: their state is saved from there
                                         (1, ["offload.resident_layers=1", "offload.resident_edges=true"])])
def test_resume_continues_the_same_training(tmp_path, accum, extra):
    """Train 6 steps; then train 3, stop, and resume to 6: the weights are bit-identical, and so is the logged
    loss of the interval the resume falls in (logged every 2 steps: step 4's is the mean over steps 3 and 4)."""
    a = tmp_path / "a"
    run_a = train(cfg(a, "max_steps=6", f"gradient_accumulation_steps={accum}", "save_steps=3", "logging_steps=2",
                      *extra))
    b = tmp_path / "b"
    train(cfg(b, "max_steps=6", f"gradient_accumulation_steps={accum}", "save_steps=3", "save_total_limit=5",
              "logging_steps=2", *extra))
    # simulate a crash after step 3: drop the later checkpoint, resume from the newest left
    import shutil
    shutil.rmtree(b / "checkpoint-6")
    r = train(cfg(b, "max_steps=6", f"gradient_accumulation_steps={accum}", "save_steps=3", "logging_steps=2",
                  "resume_from_checkpoint=auto", *extra))
    assert r["history"][0]["step"] == 4
    logged = lambda run: [(h["step"], h["loss"], h["target_tokens"]) for h in run["history"]]  # noqa: E731
    assert logged(r) == logged(run_a)[1:]
    ma, mb = master(a / "checkpoint-6"), master(b / "checkpoint-6")
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


def test_save_total_limit_keeps_the_newest(tmp_path):
    train(cfg(tmp_path, "max_steps=4", "save_steps=1", "save_total_limit=2"))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


@pytest.mark.parametrize("bad,match", [("save_total_limit=-1", "save_total_limit must be >= 1, or null"),
                                       ("save_total_limit=0", "save_total_limit must be >= 1, or null"),
                                       ("save_steps=-3", "save_steps must be >= 0")])
def test_checkpoint_settings_are_validated(tmp_path, bad, match):
    with pytest.raises(ConfigError, match=match):
        cfg(tmp_path, bad)


def interrupt_at_step(monkeypatch, n: int):
    """The engine's ``n``-th train_step sends SIGINT to this process (handled: that step finishes, the run
    saves and stops); returns the real train_step."""
    from slideformer.engine.engine import SlideEngine

    real = SlideEngine.train_step
    calls = {"n": 0}

    def step_then_interrupt(self, batch):
        calls["n"] += 1
        if calls["n"] == n:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, batch)

    monkeypatch.setattr(SlideEngine, "train_step", step_then_interrupt)
    return real


def test_ctrl_c_saves_and_exits_130(tmp_path, monkeypatch):
    interrupt_at_step(monkeypatch, 2)
    code = main(["train"] + FAST + [f"output_dir={tmp_path}", "max_steps=50"])
    assert code == 130
    assert (tmp_path / "checkpoint-2" / "state" / "trainer.json").is_file()


def test_an_evaluation_a_signal_put_off_runs_first_on_resume_and_the_plot_has_every_step(tmp_path, monkeypatch):
    """SIGINT at an evaluation's step: the checkpoint is saved and the evaluation put off (stopping comes
    first); the resumed run evaluates that step before its next one. The loss plot's curves are the run's
    metrics from step 1, not only the resumed run's steps."""
    from slideformer.engine.engine import SlideEngine
    from slideformer.train.loop import loss_curves

    real = interrupt_at_step(monkeypatch, 2)
    run = FAST + [f"output_dir={tmp_path}", "max_steps=4", "val_size=0.1", "eval_steps=2"]
    assert main(["train"] + run) == 130
    assert loss_curves(tmp_path / "metrics.jsonl")[1] == []
    monkeypatch.setattr(SlideEngine, "train_step", real)
    assert main(["train"] + run) == 0
    history, evals = loss_curves(tmp_path / "metrics.jsonl")
    assert [h["step"] for h in history] == [1, 2, 3, 4] and [e["step"] for e in evals] == [2, 4]


def test_an_evaluation_a_kill_cut_short_runs_on_resume_and_a_logged_one_does_not_run_twice(tmp_path, monkeypatch):
    """A checkpoint saved at an evaluation's step records it as pending: where the process dies during that
    evaluation (a kill, the OOM killer, a failure), the resumed run evaluates that step first; where the
    evaluation's record made it to metrics.jsonl before the run died, it is not run again."""
    from slideformer.engine.engine import SlideEngine
    from slideformer.train import loop
    from slideformer.train.loop import loss_curves

    run = FAST + [f"output_dir={tmp_path}", "max_steps=4", "val_size=0.1", "eval_steps=2", "save_steps=2"]
    real_eval = loop._evaluate

    def dies(*a, **k):
        raise RuntimeError("killed during the evaluation")

    monkeypatch.setattr(loop, "_evaluate", dies)
    assert main(["train"] + run) == 1
    assert (tmp_path / "checkpoint-2").is_dir() and loss_curves(tmp_path / "metrics.jsonl")[1] == []
    monkeypatch.setattr(loop, "_evaluate", real_eval)
    assert main(["train"] + run) == 0
    assert [e["step"] for e in loss_curves(tmp_path / "metrics.jsonl")[1]] == [2, 4]
    # step 2's evaluation logged, then the run dies in step 3: resumed from checkpoint-2, not evaluated again
    out = tmp_path / "again"
    run = FAST + [f"output_dir={out}", "max_steps=4", "val_size=0.1", "eval_steps=2", "save_steps=2"]
    real_step, calls = SlideEngine.train_step, {"n": 0}

    def step_3_dies(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed in step 3")
        return real_step(self, batch)

    monkeypatch.setattr(SlideEngine, "train_step", step_3_dies)
    assert main(["train"] + run) == 1
    monkeypatch.setattr(SlideEngine, "train_step", real_step)
    assert main(["train"] + run) == 0
    assert [e["step"] for e in loss_curves(out / "metrics.jsonl")[1]] == [2, 4]


def test_throughput_is_of_the_steps_an_evaluation_fell_between(tmp_path, monkeypatch):
    """tokens_per_s over a logging interval with an evaluation inside it: the interval's tokens over its
    steps' time (the evaluation's time left out, and not the steps before it either)."""
    from slideformer.engine.engine import SlideEngine
    from slideformer.train import loop

    clock = [1000.0]
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    real_step, real_eval = SlideEngine.train_step, loop._evaluate

    counted = [0]

    def step(self, batch):
        clock[0] += 1.0  # (each step a second)
        counted[0] += sum(m["input_ids"].numel() if m.get("attention_mask") is None else int(m["attention_mask"].sum())
                          for m in batch)
        return real_step(self, batch)

    def evaluation(*a, **k):
        clock[0] += 100.0
        return real_eval(*a, **k)

    monkeypatch.setattr(SlideEngine, "train_step", step)
    monkeypatch.setattr(loop, "_evaluate", evaluation)
    out = tmp_path / "o"
    assert main(["train"] + FAST[:-2] + [f"output_dir={out}", "max_steps=4", "logging_steps=4", "val_size=0.1",
                                         "eval_steps=2", "max_grad_norm=null"]) == 0
    rec = next(r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "tokens_per_s" in r)
    assert rec["tokens_per_s"] == pytest.approx(counted[0] / 4.0)  # (four steps of a second each)


def _finite_checkpoints(out):
    for ck in out.glob("checkpoint-*"):
        for f in (ck / "state").glob("*.safetensors"):
            assert all(torch.isfinite(t).all() for t in load_file(str(f)).values()), f


@pytest.mark.parametrize("clip", ["1.0", "null"])
def test_a_diverging_run_stops_without_saving_nan(tmp_path, clip, capsys):
    """learning_rate=1e6: step 2's gradient norm is NaN. Exit 4; every checkpoint on disk is finite, the
    metrics are valid JSON, and the message says what happened to the update and what to change."""
    out = tmp_path / "o"
    code = main(["train"] + FAST[:-1] + [f"max_grad_norm={clip}", f"output_dir={out}", "learning_rate=1e6",
                                         "warmup_ratio=0", "save_steps=1", "max_steps=6"])
    err = capsys.readouterr().err
    assert code == 4 and err.count("\n") == 1
    assert "gradient norm nan" in err and "checkpoint-1) is intact" in err
    if clip == "null":
        assert "applied in memory" in err and "set max_grad_norm" in err
    else:
        assert "dropped" in err and "set max_grad_norm" not in err and "skip_nonfinite_steps" in err
    _finite_checkpoints(out)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize("tracker,folder", [("tensorboard", "tensorboard")])  # (the others': test_outdir.py)
def test_a_run_that_diverges_at_once_can_be_run_again_with_the_fix(tmp_path, capsys, monkeypatch, tracker, folder):
    """A new run that stops before any metric or checkpoint leaves its folder as it found it, its trackers'
    files too: the same command with a sane learning rate then trains there (the folder was refused as
    "not empty and not written by slideformer")."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "o"
    args = ["train"] + FAST + [f"output_dir={out}", "max_steps=3", "logging_steps=2", f"report_to={tracker}"]
    assert main(args + ["learning_rate=1e30", "warmup_ratio=0"]) == 4
    assert not out.exists()
    assert main(args + ["learning_rate=1e-4"]) == 0
    mine = tmp_path / "mine"
    (mine / folder).mkdir(parents=True)
    (mine / folder / "notes.txt").write_text("keep")  # (a folder it did not make stays, with its files)
    assert main(args + [f"output_dir={mine}", "learning_rate=1e30", "warmup_ratio=0", "overwrite_output_dir=true"]) == 4
    assert (mine / folder / "notes.txt").read_text() == "keep"
    capsys.readouterr()


def test_skip_nonfinite_steps_goes_on_with_the_next_data(tmp_path, monkeypatch):
    from slideformer.engine import engine as engine_mod

    real, calls = engine_mod.fused_head_loss, {"n": 0}

    def head(*a, **k):  # the third step's gradient is NaN
        part, gh = real(*a, **k)
        calls["n"] += 1
        return part, gh * float("nan") if calls["n"] == 3 else gh

    monkeypatch.setattr(engine_mod, "fused_head_loss", head)
    r = train(cfg(tmp_path, "max_steps=4", "max_grad_norm=1.0", "skip_nonfinite_steps=true"))
    assert r["steps"] == 4 and r["dropped_steps"] == 1 and r["status"] == "finished"
    _finite_checkpoints(tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs] == [1, 2, 3, 4] and recs[-1]["dropped_steps"] == 1
    with pytest.raises(ConfigError, match="skip_nonfinite_steps needs max_grad_norm"):
        cfg(tmp_path, "skip_nonfinite_steps=true")


def test_nonfinite_metrics_are_written_as_null(tmp_path):
    from slideformer.train.loop import _finite

    assert json.loads(json.dumps(_finite({"a": math.nan, "b": math.inf, "c": 1.0}), allow_nan=False)) == \
        {"a": None, "b": None, "c": 1.0}


def test_bad_records_error_or_are_skipped(tmp_path):
    d = tmp_path / "d.jsonl"
    d.write_text("\n".join([json.dumps({"text": f"sample {i}"}) for i in range(8)] +
                           [json.dumps({"conversations": [{"from": "alien", "value": "x"}]})]) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:9: sharegpt record turn 0"):
        train(cfg(tmp_path / "o", f"dataset=[{d}]", "max_steps=1"))
    r = train(cfg(tmp_path / "o", f"dataset=[{d}]", "max_steps=1", "skip_bad_records=true"))
    assert r["skipped_records"] == 1
    assert main(["train"] + FAST + [f"output_dir={tmp_path}/p", f"dataset=[{d}]", "max_steps=1"]) == 2


def test_train_refuses_what_the_host_cannot_hold(tmp_path, monkeypatch):
    from slideformer import machine
    from slideformer.plan import DoesNotFit

    from slideformer.plan.memory import HOST_SHARE, PROCESS_BYTES

    # (a machine whose RAM holds the process itself and 1 MiB more; then one that does not hold the process)
    monkeypatch.setattr(machine, "host_memory", lambda: int((PROCESS_BYTES + 2**20) / HOST_SHARE) + 1)
    with pytest.raises(DoesNotFit, match="host RAM.*offload_dir"):
        train(cfg(tmp_path, "max_steps=1"))
    assert main(["train"] + FAST + [f"output_dir={tmp_path}", "max_steps=1"]) == 3
    monkeypatch.setattr(machine, "host_memory", lambda: 2**20)
    with pytest.raises(DoesNotFit, match="the process itself takes about 2.0 GiB of host RAM .* more than the 0.9 MiB"):
        train(cfg(tmp_path, "max_steps=1"))
    assert not list(tmp_path.glob("checkpoint-*"))


def test_nvme_settings_reach_the_engine(tmp_path):
    r = train(cfg(tmp_path / "o", "max_steps=2", f"offload.offload_dir={tmp_path / 'nvme'}", "offload.nvme_fraction=0.5"))
    assert r["steps"] == 2 and not (tmp_path / "nvme").exists()  # (the tier's folder, made by the run, goes with it)


def test_packing_trains_and_resumes(tmp_path):
    a = tmp_path / "a"
    r = train(cfg(a, "max_steps=4", "packing=true", "cutoff_len=96", "micro_batch_size=2", "save_steps=2"))
    assert r["steps"] == 4 and all(math.isfinite(h["loss"]) for h in r["history"])
    b = tmp_path / "b"
    opts = ["max_steps=4", "packing=true", "cutoff_len=96", "micro_batch_size=2", "save_steps=2", "save_total_limit=5"]
    train(cfg(b, *opts))
    import shutil
    shutil.rmtree(b / "checkpoint-4")  # a crash after step 2
    train(cfg(b, *opts, "resume_from_checkpoint=auto"))
    ma, mb = master(a / "checkpoint-4"), master(b / "checkpoint-4")
    assert all(torch.equal(ma[k], mb[k]) for k in ma)


@pytest.mark.parametrize("packing", [True, False])
def test_a_micro_batchs_tokens_leave_out_its_padding(packing):
    """tokens_per_s and tflops count the samples' tokens: a packed row's unused tail, as a padded row's end,
    is no work done (packed rows were counted whole)."""
    from slideformer.train.loop import _draw

    examples = [(list(range(n)), list(range(n))) for n in (30, 20, 50, 40)]
    mb, offset, tokens = _draw(examples, [0, 1, 2, 3], 0, 2, packing, 64, 0)
    assert (offset, tokens) == ((3, 100) if packing else (2, 50))  # (packed: 30+20 | 50; 40 would start a third)
    assert mb["input_ids"].shape == ((2, 64) if packing else (2, 30))


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("accum", [1, 3])
def test_num_train_epochs_is_that_many_passes_over_the_samples(tmp_path, packed, accum):
    """The steps num_train_epochs gives draw from that many epochs' orders, never the next: packed, an epoch
    is its samples' packed rows (it counted samples, a row's worth each: several epochs in one); with
    accumulation, whole steps of each epoch's micro-batches (a step may span two epochs' orders)."""
    opts = ["max_steps=-1", "cutoff_len=96", "micro_batch_size=2", f"gradient_accumulation_steps={accum}",
            f"packing={str(packed).lower()}"]
    one = train(cfg(tmp_path / "one", *opts, "num_train_epochs=1"))
    two = train(cfg(tmp_path / "two", *opts, "num_train_epochs=2"))
    drawn_from = lambda run: {math.ceil(h["epoch"]) - 1 for h in run["history"]}  # noqa: E731  (1.0: epoch 0's end)
    assert drawn_from(one) == {0} and one["history"][-1]["step"] == one["steps"]
    assert drawn_from(two) == {0, 1}
    assert 2 * one["steps"] - 1 <= two["steps"] <= 2 * one["steps"] + 1  # (another order packs a row more or less)
    micro_batches = 112 // 2  # (the bundled data's 112 samples, two a micro-batch)
    if packed:  # (several samples a row)
        assert one["steps"] < micro_batches // accum // 2
    else:
        assert one["steps"] == micro_batches // accum


def test_packing_data_read_as_reached_needs_max_steps(tmp_path, monkeypatch):
    """Read as the steps reach it, the data's packed rows are not known up front: num_train_epochs is
    refused there (an epoch was a count of records), max_steps trains."""
    from slideformer.plan import memory

    monkeypatch.setattr(memory, "data_in_ram", lambda *a: False)
    opts = ["packing=true", "cutoff_len=96", "micro_batch_size=2"]
    with pytest.raises(DataError, match="packing: the dataset is read as the steps reach it.*set max_steps"):
        train(cfg(tmp_path / "a", *opts, "max_steps=-1", "num_train_epochs=1"))
    assert train(cfg(tmp_path / "b", *opts, "max_steps=2"))["steps"] == 2


def test_resident_layers_auto_is_accepted_and_trains(tmp_path):
    c = cfg(tmp_path, "max_steps=2", "offload.resident_layers=auto")
    assert c.offload.resident_layers == "auto"
    assert train(c)["steps"] == 2  # on the CPU "auto" keeps every layer streamed (the optimizer thread overlaps)
    with pytest.raises(ConfigError, match="must be a number"):
        load_config(None, ["offload.resident_layers=many"])


def test_auto_residency_follows_the_budget():
    """The trainer's resolve (plan.resolve) on a GPU of the given budget, from machine facts alone."""
    from slideformer import EngineConfig
    from slideformer.machine import Machine
    from slideformer.presets import preset_config
    from slideformer.train.loop import resolve_engine

    c = load_config(None, FAST + ["cutoff_len=256"])
    examples = [([1] * 64, [1] * 64)]
    hf = preset_config("tiny")
    machine = Machine(ram=1 << 40, gpu=None)  # (the budget is gpu_memory_limit's)
    roomy = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, gpu_memory_limit="1GiB")
    assert resolve_engine(c, hf, roomy, examples, machine).placement.resident_layers == hf.num_hidden_layers
    tight = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, gpu_memory_limit="7MiB")
    chosen = resolve_engine(c, hf, tight, examples, machine)
    assert 0 <= chosen.placement.resident_layers < hf.num_hidden_layers
    # a fixed offload.resident_edges is kept (here the planner would take them); the layers are still its call
    assert chosen.placement.resident_edges is True
    declined = load_config(None, FAST + ["offload.resident_edges=false", "cutoff_len=256"])
    assert resolve_engine(declined, hf, tight, examples, machine).placement.resident_edges is False
    with pytest.raises(ConfigError, match="resident_edges must be true, false or auto"):
        load_config(None, FAST + ["offload.resident_edges=maybe"])


def test_train_says_once_where_the_model_trains(tmp_path, capsys):
    train(cfg(tmp_path, "max_steps=2"))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("slideformer: ")]
    assert len(lines) == 1  # once, at start
    assert "trained on the device: 0 of 4 layers" in lines[0] and "CPU AdamW" in lines[0] and "on cpu" in lines[0]


def test_host_weights_auto_stages_when_the_copy_would_crowd_the_ram(monkeypatch):
    """The trainer decides offload.host_weights: auto from the machine's RAM: with the whole bf16 copy the
    state needs over 85% of it, so the run stages the fewest layers that bring it under, rather than
    refusing or swapping. (A machine of a few MiB, the tiny model's scale: the process's own bytes, which
    would not fit it, are left out.)"""
    from slideformer import plan
    from slideformer.plan import memory

    monkeypatch.setattr(memory, "PROCESS_BYTES", 0)
    from slideformer.machine import Machine
    from slideformer.presets import preset_config
    from slideformer.train.loop import resolve_engine

    c = load_config(None, FAST + ["bf16=true", "cutoff_len=256"])
    hf = preset_config("tiny")
    eng = EngineConfig(device="cpu", compute_dtype=torch.bfloat16)
    sh = plan.ModelShape.from_adapter(ModelAdapter(hf, torch.bfloat16))
    p = plan.Layout.of(eng, micro_batch=c.micro_batch_size)
    with_copy = sum(plan.config_host_bytes(eng, sh, c.micro_batch_size, 64, p, "persistent").values())
    examples = [([1] * 64, [1] * 64)]
    chosen = resolve_engine(c, hf, eng, examples, Machine(ram=int(with_copy / 0.9)))
    assert isinstance(chosen.placement.host_weights, int) and 0 < chosen.placement.host_weights < hf.num_hidden_layers
    assert sum(plan.config_host_bytes(chosen, sh, c.micro_batch_size, 64, p).values()) <= 0.85 * with_copy / 0.9
    assert resolve_engine(c, hf, eng, examples, Machine(ram=int(with_copy / 0.8))).placement.host_weights == "persistent"
    fixed = load_config(None, FAST + ["bf16=true", "offload.host_weights=persistent", "cutoff_len=256"])
    assert resolve_engine(fixed, hf, eng, examples, Machine(ram=int(with_copy / 0.9))).placement.host_weights == "persistent"


def test_the_offload_section_is_the_engines_settings_by_name():
    """The trainer hands offload.* to EngineConfig and its Placement by name: a key the engine lacks would
    fail every run, and only placement keys may be left to the planner ("auto")."""
    import dataclasses

    from slideformer.config import Placement
    from slideformer.train.config import OffloadConfig
    from slideformer.train.loop import _placement

    engine_keys = {f.name for f in dataclasses.fields(EngineConfig)}
    placement_keys = {f.name for f in dataclasses.fields(Placement)}
    offload = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
    assert set(offload) <= engine_keys | placement_keys
    assert {k for k, v in offload.items() if v == "auto"} <= placement_keys
    assert _placement(OffloadConfig()) == Placement()  # "auto" holds Placement's defaults until resolved
    assert _placement(OffloadConfig(resident_layers=3, window_slots=4)) == Placement(resident_layers=3, window_slots=4)


def test_a_signal_during_dropped_steps_saves_the_last_good_step(tmp_path, monkeypatch):
    """Steps that keep coming out non-finite (skipped) must not hold back a SIGTERM: the run saves the last
    finished step's state and exits 143 at once."""
    from slideformer.engine import engine as engine_mod
    from slideformer.engine.engine import SlideEngine

    real_head, real_step, calls = engine_mod.fused_head_loss, SlideEngine.train_step, {"n": 0}

    def nan_after_one(*a, **k):
        part, gh = real_head(*a, **k)
        return part, gh if calls["n"] <= 1 else gh * float("nan")

    def step(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self, batch)

    monkeypatch.setattr(engine_mod, "fused_head_loss", nan_after_one)
    monkeypatch.setattr(SlideEngine, "train_step", step)
    code = main(["train"] + FAST[:-1] + [f"output_dir={tmp_path}", "max_steps=50", "max_grad_norm=1.0",
                                         "skip_nonfinite_steps=true"])
    assert code == 143 and calls["n"] == 3
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]


def test_held_out_evaluation_is_logged_and_kept_out_of_training(tmp_path):
    """val_size keeps a seeded fifth of the samples out of training; they are evaluated every eval_steps and
    at the end: eval loss and perplexity in metrics.jsonl, TensorBoard and the result; the loss is then the
    engine's forward-only loss on those samples. eval_dataset names held-out files instead; both at once,
    and a fraction outside [0, 1), are refused."""
    from slideformer.train.loop import VAL_SPLIT_SEED, _evaluate, build_examples, load_tokenizer

    c = cfg(tmp_path / "run", "max_steps=4", "val_size=0.2", "eval_steps=3")
    result = train(c)
    evals = result["evals"]
    assert [e["step"] for e in evals] == [3, 4] and all(e["eval_ppl"] == pytest.approx(math.exp(e["eval_loss"]))
                                                         for e in evals)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 4]
    assert list((tmp_path / "run" / "tb").glob("events.*")) or list((tmp_path / "run").rglob("events.*"))
    # the samples held out: the seeded fifth, none of which was trained on; evaluated again from the checkpoint
    tok = load_tokenizer(c)
    examples, *_ = build_examples(c, tok, None)
    pick = torch.randperm(len(examples), generator=torch.Generator().manual_seed(VAL_SPLIT_SEED)).tolist()
    held = [examples[i] for i in sorted(pick[: round(0.2 * len(examples))])]
    from slideformer import SlideEngine
    from slideformer.presets import preset_config

    with SlideEngine.from_config(preset_config("tiny"), EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
        eng.load_checkpoint(result["checkpoint"])
        again = _evaluate(eng, held, 4, tok.pad_token_id, 4)
    assert again["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-6) and again["eval_tokens"] == \
        evals[-1]["eval_tokens"]
    with pytest.raises(ConfigError, match="set one of them"):
        load_config(None, ["val_size=0.1", "eval_dataset=x.jsonl"])
    with pytest.raises(ConfigError, match="val_size must lie in"):
        load_config(None, ["val_size=1.0"])
    with pytest.raises(ConfigError, match="eval_steps needs held-out data"):
        load_config(None, ["eval_steps=5"])


def test_the_logged_loss_is_the_intervals_mean(tmp_path):
    """logging_steps=2: the loss logged at step 2 is the token-weighted mean of steps 1 and 2 (as logged one
    by one by the same training), not step 2's alone."""
    for packed in ([], ["packing=true", "cutoff_len=100", "micro_batch_size=2"]):
        one = train(cfg(tmp_path / f"a{len(packed)}", "max_steps=2", *packed))["history"]
        two = train(cfg(tmp_path / f"b{len(packed)}", "max_steps=2", "logging_steps=2", *packed))["history"]
        (a, n), (b, m) = [(h["loss"], h["target_tokens"]) for h in one]
        assert n != m and len(two) == 1 and two[0]["target_tokens"] == n + m
        assert two[0]["loss"] == pytest.approx((a * n + b * m) / (n + m), rel=1e-9)  # weighted, not (a + b) / 2
        assert abs(two[0]["loss"] - (a + b) / 2) > 1e-6


def test_generation_config_travels_into_checkpoints_and_exports(tmp_path):
    """A source model's generation_config.json (its sampling defaults) is in every checkpoint and export."""
    from importlib import resources

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from slideformer.presets import preset_config

    src = tmp_path / "model"
    AutoModelForCausalLM.from_config(preset_config("tiny")).save_pretrained(src)
    AutoTokenizer.from_pretrained(str(resources.files("slideformer") / "assets" / "tiny")).save_pretrained(src)
    GenerationConfig(do_sample=True, temperature=0.3, max_new_tokens=17).save_pretrained(src)
    sample = resources.files("slideformer") / "assets" / "sample" / "text.jsonl"
    result = train(cfg(tmp_path / "run", "max_steps=1", f"model_name_or_path={src}", f"dataset={sample}"))
    assert GenerationConfig.from_pretrained(result["checkpoint"]).temperature == 0.3
    assert main(["export", result["checkpoint"], str(tmp_path / "hf")]) == 0
    assert GenerationConfig.from_pretrained(tmp_path / "hf").max_new_tokens == 17


def test_export_writes_the_training_master_in_the_dtype_asked_for(tmp_path):
    """A bf16 run with compact state: its checkpoint's weights are bf16 (the compute copy); export --dtype fp32
    writes the master itself (hi + lo, exactly what training holds), and --dtype bf16 that rounded."""
    from transformers import AutoModelForCausalLM

    from slideformer import SlideEngine
    from slideformer.presets import preset_config

    result = train(cfg(tmp_path / "run", "max_steps=2", "bf16=true", "offload.optimizer_state=compact"))
    ck = result["checkpoint"]
    with SlideEngine.from_config(preset_config("tiny"), EngineConfig(device="cpu", optimizer_state="compact")) as eng:
        eng.load_checkpoint(ck)
        master = {k: v.clone() for k, v in eng.state_dict().items()}
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        assert main(["export", ck, str(tmp_path / dtype), "--dtype", dtype]) == 0
        got = load_file(str(tmp_path / dtype / "model.safetensors"))
        assert all(got[k].dtype == torch_dtype and torch.equal(got[k], master[k].to(torch_dtype)) for k in got)
        assert AutoModelForCausalLM.from_pretrained(tmp_path / dtype).dtype == torch_dtype
    plain = load_file(str(tmp_path / "plain" / "model.safetensors")) if main(
        ["export", ck, str(tmp_path / "plain")]) == 0 else None
    assert plain is not None and all(v.dtype == torch.bfloat16 for v in plain.values())
    assert any(not torch.equal(plain[k].float(), master[k]) for k in plain)  # (the master is finer than bf16)


def test_every_seed_the_config_accepts_orders_the_data():
    """A seed up to 2**63 (the config's bound) orders each epoch (its generator's seed is 64 bits); the seeds
    runs used before keep their order, so their checkpoints resume on the same data."""
    from slideformer.train.loop import _permutation

    big = [_permutation(50, 2**63 - 1, e) for e in (0, 1)]
    assert sorted(big[0]) == list(range(50)) and list(big[0]) != list(big[1])
    g = torch.Generator().manual_seed(7 * 1_000_003 + 2)
    assert list(_permutation(50, 7, 2)) == list(torch.randperm(50, generator=g).numpy())


def test_many_epochs_are_counted_at_once(tmp_path, monkeypatch):
    """num_train_epochs decides the steps without a pass per epoch (1e12 epochs would hang start-up; an alarm
    turns that into a failure); with packing each epoch's rows are counted, so past MAX_PACKED_EPOCHS it asks
    for max_steps."""
    from slideformer.engine import SlideEngine
    from slideformer.train.config import MAX_PACKED_EPOCHS
    from tiny import within

    class Built(Exception):
        pass

    def built(*a, **k):
        raise Built

    monkeypatch.setattr(SlideEngine, "from_config", built)
    with within(60, "counting the epochs' steps took over 60 s"), pytest.raises(Built):
        train(cfg(tmp_path / "a", "max_steps=-1", "num_train_epochs=1e12"))
    with pytest.raises(ConfigError, match=rf"with packing: .* \(up to {MAX_PACKED_EPOCHS} epochs\); set max_steps"):
        cfg(tmp_path / "b", "max_steps=-1", f"num_train_epochs={MAX_PACKED_EPOCHS + 1}", "packing=true").validate()


def test_a_key_given_twice_in_the_config_file_is_refused(tmp_path):
    """YAML keeps the last of a key written twice, unsaid: the config names the key and both lines. A merged
    mapping (<<) is overridden by its own keys, as YAML means."""
    f = tmp_path / "c.yaml"
    f.write_text("model_name_or_path: tiny\nlearning_rate: 3.0e-3\nmax_steps: 2\nlearning_rate: 1.0e-5\n")
    with pytest.raises(ConfigError, match=r"c.yaml, line 4: learning_rate is given twice \(also on line 2;"):
        load_config(f)
    f.write_text("model_name_or_path: tiny\noffload: {host_weights: staged, host_weights: pinned}\n")
    with pytest.raises(ConfigError, match="line 2: host_weights is given twice"):
        load_config(f)
    f.write_text("model_name_or_path: tiny\noffload: {<<: {host_weights: pinned}, host_weights: staged}\n")
    assert load_config(f).offload.host_weights == "staged"


def test_an_update_that_overflows_says_the_learning_rate(tmp_path, capsys):
    """Finite losses, a state gone infinite (a learning rate fp32 cannot hold): nothing non-finite is saved, and
    the line (exit 4) names the intact checkpoint and the fix."""
    from slideformer.cli import main

    assert main(["train", "progress=false", "device=cpu", f"output_dir={tmp_path}", "max_steps=2", "save_steps=1",
                 "learning_rate=1e39", "max_grad_norm=null"]) == 4
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds NaN or infinite values; the state is not saved (the previous checkpoint" in line
    assert line.endswith("lower learning_rate (now 1e+39)")
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1"]


def test_epochs_short_of_a_step_train_one_step_not_at_rate_zero(tmp_path, capsys):
    """num_train_epochs whose micro-batches fall short of one step train one (drawn over as many epochs as it
    takes), said at the start; warmup stops short of the last step, whose rate would otherwise be 0 (the
    first warmup step's): a run that was all warmup trained nothing."""
    r = train(cfg(tmp_path, "max_steps=-1", "num_train_epochs=1", "gradient_accumulation_steps=64",
                  "warmup_ratio=0.1", "learning_rate=1e-3"))
    assert r["steps"] == 1 and r["history"][0]["lr"] == pytest.approx(1e-3)
    assert "one step is trained, its micro-batches drawn from as many epochs as it takes" in capsys.readouterr().err
    # (the bundled 112 samples: 14 micro-batches of 8, 3 steps of 4; the last 2 micro-batches are said untrained)
    r = train(cfg(tmp_path / "b", "max_steps=-1", "num_train_epochs=1", "micro_batch_size=8",
                  "gradient_accumulation_steps=4"))
    assert r["steps"] == 3
    assert "holds 14 micro-batches, 3 step(s) of 4: the last 2 (16 samples) are short of a step and not trained " \
           "(max_steps: 4 trains them" in capsys.readouterr().err


@pytest.mark.parametrize("warmup,steps", [("warmup_steps=3", 3), ("warmup_steps=0.5", 4), ("warmup_ratio=0.25", 2)])
def test_warmup_in_steps_or_a_fraction_of_them_as_transformers_5(tmp_path, warmup, steps):
    """transformers 5's warmup_steps: a count (>= 1), or a fraction of the steps (< 1), replacing warmup_ratio
    (which transformers 4 had, as LLaMA-Factory does); the rates are get_scheduler's."""
    from slideformer.optim import lr_at

    r = train(cfg(tmp_path, "max_steps=7", "learning_rate=1e-3", warmup))
    assert [h["lr"] for h in r["history"]] == pytest.approx(
        [lr_at(k, 1e-3, "cosine", warmup_steps=steps, total_steps=7) for k in range(7)])


def test_warmup_ratio_and_warmup_steps_in_one_place_are_refused_and_an_override_replaces_the_other(tmp_path):
    """transformers 4 read warmup_steps 0 as "use the ratio", transformers 5 has no ratio: both in a file (or
    both on the command line) cannot say which is meant. One overriding the file's other replaces it."""
    (tmp_path / "both.yaml").write_text("model_name_or_path: tiny\nwarmup_ratio: 0.5\nwarmup_steps: 0\n")
    with pytest.raises(ConfigError, match="warmup_ratio and warmup_steps both set the warmup: keep one"):
        load_config(tmp_path / "both.yaml", [])
    with pytest.raises(ConfigError, match="both set the warmup"):
        load_config(None, ["warmup_ratio=0.5", "warmup_steps=0"])
    (tmp_path / "ratio.yaml").write_text("model_name_or_path: tiny\nwarmup_ratio: 0.5\n")
    (tmp_path / "steps.yaml").write_text("model_name_or_path: tiny\nwarmup_steps: 3\n")
    assert load_config(tmp_path / "ratio.yaml", ["warmup_steps=2"]).warmup_steps == 2
    c = load_config(tmp_path / "steps.yaml", ["warmup_ratio=0.2"])
    assert c.warmup_steps is None and c.warmup_ratio == 0.2
    assert load_config(None, ["warmup_steps=4"]).warmup_steps == 4  # (the demo's own ratio is replaced)


def test_records_read_twice_or_evaluated_as_trained_are_refused(tmp_path):
    """A folder and a file in it (of the folder's split), or a save_to_disk folder for both dataset and
    eval_dataset (each defaults to its train split), read the same records: trained twice, or evaluated on
    training samples, unsaid. Another split, or a file of the folder's other split, is held-out data."""
    import datasets

    from slideformer.train.loop import build_examples, held_out, load_tokenizer

    folder = tmp_path / "f"
    folder.mkdir()
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{split} {i}"}) + "\n" for i in range(4)))
    datasets.DatasetDict({s: datasets.Dataset.from_list([{"text": f"{s} {i}"} for i in range(4)])
                          for s in ("train", "test")}).save_to_disk(str(tmp_path / "dd"))

    def run(*opts):
        c = cfg(tmp_path / "run", "cutoff_len=64", *opts)
        tok = load_tokenizer(c)
        return held_out(c, tok, None, build_examples(c, tok, None)[0])

    with pytest.raises(DataError, match=r"dataset lists .*f and .*train.jsonl, which both read .*f/train.jsonl: its "
                                        "records would count twice"):
        run(f"dataset=[{folder}, {folder / 'train.jsonl'}]")
    assert len(run(f"dataset=[{folder}, {folder / 'test.jsonl'}]")[0]) == 8
    with pytest.raises(DataError, match=r"eval_dataset .*train.jsonl reads .*train.jsonl, which dataset trains on"):
        run(f"dataset={folder}", f"eval_dataset={folder / 'train.jsonl'}")
    with pytest.raises(DataError, match=r"eval_dataset .*dd reads .*dd \(split train\), which dataset trains on"):
        run(f"dataset={tmp_path / 'dd'}", f"eval_dataset={tmp_path / 'dd'}")
    train_part, held, _ = run(f"dataset={tmp_path / 'dd'}", f"eval_dataset={{path: {tmp_path / 'dd'}, split: test}}")
    assert (len(train_part), len(held)) == (4, 4)
    assert len(run(f"dataset={folder}", f"eval_dataset={folder / 'test.jsonl'}")[1]) == 4


@pytest.mark.parametrize("lazy", [False, True])
def test_a_file_listed_with_format_auto_and_with_the_format_it_finds_is_refused(tmp_path, lazy):
    """format auto and the format auto finds in a file read it alike: listed both ways, its records would count
    twice, unsaid. Listed as another format (its text alone, say) it is other data."""
    from slideformer.train.loop import build_examples, load_tokenizer
    from slideformer.train.config import _assets

    f = _assets() / "sample" / "alpaca.jsonl"
    c = cfg(tmp_path, f"dataset=[{f}, {{path: {f}, format: alpaca}}]", "cutoff_len=128")
    with pytest.raises(DataError, match=r"dataset lists .*alpaca.jsonl twice, read alike: format auto reads it as "
                                        "alpaca"):
        build_examples(c, load_tokenizer(c), None, lazy=lazy)
    bad = tmp_path / "bad.jsonl"  # (a first line that is not JSON, skipped: the records after it tell)
    bad.write_text("not json\n" + f.read_text())
    c = cfg(tmp_path, f"dataset=[{bad}, {{path: {bad}, format: alpaca}}]", "cutoff_len=128", "skip_bad_records=true")
    with pytest.raises(DataError, match=r"bad.jsonl twice, read alike"):
        build_examples(c, load_tokenizer(c), None, lazy=lazy)
    (tmp_path / "t.jsonl").write_text('{"text": "a", "instruction": "b", "output": "c"}\n')
    mixed = tmp_path / "mixed.jsonl"  # (auto reads its first record as alpaca, the next as text: not alike)
    mixed.write_text('{"instruction": "b", "output": "c"}\n{"text": "a"}\n')
    c = cfg(tmp_path, f"dataset=[{mixed}, {{path: {mixed}, format: alpaca}}]", "cutoff_len=128",
            "skip_bad_records=true")
    assert len(build_examples(c, load_tokenizer(c), None, lazy=lazy)[0]) == 4
    t = tmp_path / "t.jsonl"
    c = cfg(tmp_path, f"dataset=[{t}, {{path: {t}, format: text}}]", "cutoff_len=128")
    assert len(build_examples(c, load_tokenizer(c), None, lazy=lazy)[0]) == 2


def test_a_tokenizer_whose_eos_is_not_the_models_is_said_at_the_start(tmp_path, capsys):
    """Text samples end with the tokenizer's eos: where the model's config (or generation_config.json) names
    another end of text (a GGUF conversion's tokenizer, SmolLM2's <|im_start|> for <|im_end|>), the model would
    learn to end with a token its generation does not stop on. Said, with the file to fix; not where it is one
    of the model's."""
    import shutil

    from slideformer.presets import preset_config
    from slideformer.train.loop import eos_note, load_tokenizer

    folder = tmp_path / "m"
    shutil.copytree(os.path.join(os.path.dirname(__import__("slideformer").__file__), "assets", "tiny"), folder)
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    c = cfg(tmp_path / "o", f"model_name_or_path={folder}", f"dataset=[{tmp_path / 'd.jsonl'}]")
    tok, hf_config = load_tokenizer(c), preset_config("tiny")
    assert tok.eos_token_id == 2 and eos_note(c, tok, hf_config) is None
    hf_config.eos_token_id = 1
    note = eos_note(c, tok, hf_config)
    assert "eos_token '<|eos|>' (id 2) is not the model's end of text" in note
    assert f"{folder}/tokenizer_config.json" in note
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert eos_note(c, tok, hf_config) is None


def test_samples_cut_at_cutoff_len_are_counted_at_the_start(tmp_path, capsys):
    """A long document is cut at cutoff_len (its tail not trained): the start says how many were."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "word " * n}) + "\n" for n in (5, 300, 8, 400, 6)))
    train(cfg(tmp_path / "o", f"dataset=[{data}]", "cutoff_len=64", "max_steps=1"))
    err = capsys.readouterr().err
    assert "2 of 5 sample(s) are longer than cutoff_len 64 and are cut there" in err


def test_train_is_adamw_with_transformers_schedule_over_the_batches_it_draws(tmp_path, monkeypatch):
    """`slideformer train` end to end, fp32 on the CPU: its data order across an epoch's end, accumulation
    weighted by the step's target tokens, clipping, weight decay where transformers' Trainer puts it, the
    cosine schedule with warmup_ratio's steps, AdamW's betas and eps, the logged loss. The same micro-batches
    trained by torch.optim.AdamW under transformers' own schedule give the same weights (within the
    reference's own noise: the same training in other orders of its sums) and losses."""
    import shutil
    from importlib import resources

    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    from slideformer.engine import SlideEngine
    from slideformer.presets import preset_config
    from test_engine_parity import assert_same, reference_noise, reference_train

    folder = tmp_path / "model"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny"), dtype=torch.float32)
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(resources.files("slideformer") / "assets" / "tiny" / f, folder / f)
    drawn, step = [], SlideEngine.train_step
    monkeypatch.setattr(SlideEngine, "train_step", lambda self, mbs, **kw: drawn.append(
        [{k: v.clone() for k, v in m.items() if v is not None} for m in mbs]) or step(self, mbs, **kw))
    alpaca = tmp_path / "alpaca.jsonl"  # (26 samples, 12 a step: 2 steps an epoch, the 2 left over passed over)
    alpaca.write_text("".join((resources.files("slideformer") / "assets" / "sample" / "alpaca.jsonl")
                              .read_text().splitlines(keepends=True)[:26]))
    kw = dict(lr=3e-3, weight_decay=0.1, max_grad_norm=0.5, betas=(0.8, 0.95), eps=1e-4)
    result = train(cfg(tmp_path / "run", f"model_name_or_path={folder}", f"dataset=[{alpaca}]", "max_steps=5",
                       "gradient_accumulation_steps=3", "lr_scheduler_type=cosine", "warmup_ratio=0.25",
                       "seed=5", f"learning_rate={kw['lr']}", f"weight_decay={kw['weight_decay']}",
                       f"max_grad_norm={kw['max_grad_norm']}", "adam_beta1=0.8", "adam_beta2=0.95",
                       f"adam_epsilon={kw['eps']}"))
    assert len(drawn) == 5 and all(len(s) == 3 and len(m["input_ids"]) == 4 for s in drawn for m in s)
    norms = [h["grad_norm"] for h in result["history"]]
    assert sum(n > kw["max_grad_norm"] for n in norms) >= 2  # (clipping acted)
    opt = torch.optim.SGD([torch.zeros(1)], lr=kw["lr"])
    schedule = get_cosine_schedule_with_warmup(opt, num_warmup_steps=math.ceil(0.25 * 5), num_training_steps=5)
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert [h["lr"] for h in result["history"]] == pytest.approx(lrs, rel=1e-12)
    ref, ref_losses = reference_train(model, drawn, lrs=lrs, **kw)
    with SlideEngine.from_pretrained(folder, EngineConfig(device="cpu", compute_dtype=torch.float32)) as eng:
        eng.load_checkpoint(result["checkpoint"])
        state = {k: v.clone() for k, v in eng.state_dict().items()}
    # adam_epsilon 1e-4 is no default's: a run that ignored it would land elsewhere (assert_same's bounds)
    assert_same(state, ref, [h["loss"] for h in result["history"]], ref_losses,
                reference_noise(model, drawn, lrs=lrs, **kw))


@pytest.mark.parametrize("lazy", [False, True])
def test_max_samples_reads_the_first_records_of_each_source(tmp_path, lazy):
    """LLaMA-Factory's max_samples: the first N records of each dataset and eval_dataset source, read up front
    or as reached alike, before val_size holds some out; the data a resume compares."""
    from slideformer.train.loop import build_examples, held_out, load_tokenizer

    for name in ("a", "b", "v"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(6)))
    c = cfg(tmp_path / "run", "cutoff_len=64", "max_samples=4", f"dataset=[{tmp_path / 'a.jsonl'}, "
            f"{tmp_path / 'b.jsonl'}]", f"eval_dataset={tmp_path / 'v.jsonl'}")
    tok = load_tokenizer(c)
    examples = build_examples(c, tok, None, lazy=lazy)[0]
    texts = [tok.decode(examples[i][0][:-1]) for i in range(len(examples))]
    assert texts == [f"{n} {i}" for n in "ab" for i in range(4)]
    assert len(held_out(c, tok, None, examples)[1]) == 4
    assert load_config(None, ["max_samples=10"]).max_samples == 10
    with pytest.raises(ConfigError, match="max_samples must be >= 1, got 0"):
        load_config(None, ["max_samples=0"])
    from slideformer.checkpoint.state import read_meta

    r = train(cfg(tmp_path / "t", "max_samples=3", "max_steps=1", "micro_batch_size=2", "cutoff_len=64",
                  f"dataset={tmp_path / 'a.jsonl'}"))
    data = read_meta(r["checkpoint"])["trainer"]["data"]
    assert data["samples"] == 3 and data["max_samples"] == 3


def test_an_evaluation_logged_as_not_finite_is_not_run_again_on_resume(tmp_path):
    """A held-out loss that is not finite is logged (as null) like any other: the same command again, which
    resumes the finished run's checkpoint, finds it logged and does not evaluate that step a second time."""
    from slideformer.train.loop import loss_curves

    opts = ("max_steps=1", "val_size=0.1", "eval_steps=1", "learning_rate=1e10", "lr_scheduler_type=constant",
            "max_grad_norm=null")
    for _ in range(2):
        train(cfg(tmp_path, *opts))
    evals = loss_curves(tmp_path / "metrics.jsonl")[1]
    assert [(e["step"], e["eval_loss"]) for e in evals] == [(1, None)]


def test_a_new_run_over_an_earlier_ones_folder_does_not_keep_its_loss_plot(tmp_path, monkeypatch):
    """overwrite_output_dir: the earlier run's metrics, events and loss.png go as the new run begins (a new run
    stopped before it logs a step must not leave another run's curve as its own)."""
    pytest.importorskip("matplotlib")
    train(cfg(tmp_path, "max_steps=2", "report_to=none"))
    assert (tmp_path / "loss.png").is_file()
    interrupt_at_step(monkeypatch, 1)
    r = train(cfg(tmp_path, "max_steps=50", "logging_steps=100", "overwrite_output_dir=true",
                  "resume_from_checkpoint=null", "report_to=none"))
    assert r["status"] == "interrupted" and not r["history"]
    assert not (tmp_path / "loss.png").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_the_logged_epoch_counts_the_epochs_records_drawn(tmp_path):
    """As transformers logs it: the epochs done and the fraction of this one's records drawn."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(10)))
    r = train(cfg(tmp_path / "o", f"dataset=[{data}]", "micro_batch_size=2", "max_steps=7", "cutoff_len=32"))
    assert [h["epoch"] for h in r["history"]] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4])


def test_a_run_resumed_at_its_new_end_evaluates_there(tmp_path, monkeypatch):
    """Held-out data is evaluated at the end: a run stopped at step 3 and resumed with max_steps 3 ends there
    without a step to train, and evaluates that step (once: the same command again does not)."""
    from slideformer.train.loop import loss_curves

    interrupt_at_step(monkeypatch, 3)
    opts = ("val_size=0.1", "eval_steps=5", "save_steps=0")
    assert train(cfg(tmp_path, "max_steps=10", *opts))["status"] == "interrupted"
    assert loss_curves(tmp_path / "metrics.jsonl")[1] == []
    for _ in range(2):
        train(cfg(tmp_path, "max_steps=3", *opts))
    assert [e["step"] for e in loss_curves(tmp_path / "metrics.jsonl")[1]] == [3]


def test_a_signal_while_the_run_closes_still_stops_its_watchdog(tmp_path, monkeypatch):
    """Ctrl-C while the trackers or the plot close: every part of the run's end is closed all the same (a
    watchdog left running would end a notebook's process minutes later)."""
    import threading

    from slideformer.train import loop

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_plot_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(cfg(tmp_path, "max_steps=2", "watchdog_seconds=600"))
    assert not [t.name for t in threading.enumerate() if t.name in ("slideformer-watchdog", "slideformer-memory-guard")]


def test_a_signal_during_a_save_stops_at_its_step(tmp_path, monkeypatch):
    """SIGTERM while a scheduled checkpoint is written: that checkpoint is the stop's, no step more is trained."""
    from slideformer.engine import SlideEngine

    real = SlideEngine.save_checkpoint

    def save_then_signal(self, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **k)

    monkeypatch.setattr(SlideEngine, "save_checkpoint", save_then_signal)
    r = train(cfg(tmp_path, "save_steps=2", "max_steps=6"))
    assert r["status"] == "interrupted" and r["steps"] == 2, r["steps"]
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-2"]


def test_a_signal_during_an_evaluation_stops_at_its_step(tmp_path, monkeypatch):
    """SIGTERM while the held-out data is evaluated: the run saves that step and stops, without training
    another (a preemption's grace is short); the resumed run does not evaluate it again."""
    from slideformer.engine import SlideEngine
    from slideformer.train.loop import loss_curves

    real = SlideEngine.evaluate

    def evaluate_then_signal(self, batch):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, batch)

    monkeypatch.setattr(SlideEngine, "evaluate", evaluate_then_signal)
    opts = ("val_size=0.1", "eval_steps=2", "save_steps=0", "max_steps=4")
    r = train(cfg(tmp_path, *opts))
    assert r["status"] == "interrupted" and r["steps"] == 2
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-2"]
    monkeypatch.setattr(SlideEngine, "evaluate", real)
    assert train(cfg(tmp_path, *opts))["status"] == "finished"
    assert [e["step"] for e in loss_curves(tmp_path / "metrics.jsonl")[1]] == [2, 4]
    # an evaluation put off to the resumed run (a signal at its step): one during it stops there too
    b = tmp_path / "b"
    interrupt_at_step(monkeypatch, 2)
    assert train(cfg(b, *opts))["steps"] == 2 and loss_curves(b / "metrics.jsonl")[1] == []
    monkeypatch.setattr(SlideEngine, "evaluate", evaluate_then_signal)
    r = train(cfg(b, *opts))
    assert r["status"] == "interrupted" and r["steps"] == 2 and not r["history"]
    assert [e["step"] for e in loss_curves(b / "metrics.jsonl")[1]] == [2]


def test_the_plan_holds_the_longest_held_out_sample(monkeypatch):
    """The GPU plan is made for rows as long as the longest training or held-out sample: evaluation runs its
    micro-batches in the same window."""
    from slideformer import plan
    from slideformer.machine import Machine
    from slideformer.presets import preset_config
    from slideformer.train.loop import resolve_engine

    seen = []
    real = plan.resolve
    monkeypatch.setattr(plan, "resolve", lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    c = load_config(None, FAST + ["cutoff_len=256"])
    eng = EngineConfig(device="cuda", compute_dtype=torch.bfloat16, gpu_memory_limit="1GiB")
    for held in ((), [([1] * 200, [1] * 200), None]):
        resolve_engine(c, preset_config("tiny"), eng, [([1] * 64, [1] * 64)], Machine(ram=1 << 40, gpu=None), held)
    assert seen == [64, 200]


def test_val_size_says_how_many_held_out_records_are_samples(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    rows = [{"instruction": "q" * (400 if i % 2 else 1), "output": "a"} for i in range(20)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train(cfg(tmp_path / "o", f"dataset=[{data}]", "cutoff_len=64", "val_size=0.2", "max_steps=1"))
    err = capsys.readouterr().err
    assert re.search(r"val_size holds out 4 records, of which \d are samples", err), err


def test_a_last_held_out_batch_short_of_the_ranks_is_evaluated_in_micro_batches():
    """Under several ranks, a last held-out batch with fewer rows than ranks goes whole to every rank: in
    micro_batch_size rows at a time (what the plan holds), its tokens counted once."""
    from types import SimpleNamespace

    from slideformer.train.loop import _evaluate

    seen = []

    def evaluate(mb):
        seen.append(len(mb["input_ids"]))
        n = int(mb["attention_mask"].sum()) - len(mb["input_ids"])  # (targets: each row's tokens but its first)
        return SimpleNamespace(loss=2.0, router_loss=0.0, tokens=n * 4)  # (summed over the 4 ranks)

    engine = SimpleNamespace(ranks=SimpleNamespace(world=4), evaluate=evaluate)
    held = [([1] * 5, [1] * 5)] * 3
    r = _evaluate(engine, held, batch=1, pad_id=0, step=7)
    assert seen == [1, 1, 1] and r["eval_tokens"] == 12 and r["eval_loss"] == 2.0
