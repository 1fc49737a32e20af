"""The CLI's one error boundary: whatever a user can get wrong ends with one line naming the file, key or
value and the fix, and the documented exit code; a bug ends with exit 1 and its traceback in a log."""
import gzip
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from slideformer.cli import main
from slideformer.train.config import _assets

FAST = ["train", "progress=false", "device=cpu", "micro_batch_size=4", "logging_steps=1", "max_grad_norm=null",
        "max_steps=1"]


def one_line(capsys, *needles):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("slideformer: ")]  # (progress notes)
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def data(tmp_path, name, content: bytes):
    p = tmp_path / name
    p.write_bytes(content)
    return p


def model_dirs(tmp_path):
    from transformers import GPT2Config

    (tmp_path / "a_file").write_text("x")
    (tmp_path / "no_config").mkdir()
    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path / "gpt2")
    from transformers import LlamaConfig

    good = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=32, vocab_size=64).to_dict()
    for name, edit in (("layers0", {"num_hidden_layers": 0}), ("heads3", {"num_attention_heads": 3}),
                       ("kv3", {"num_key_value_heads": 3}), ("ffn_neg", {"intermediate_size": -5}),
                       ("a_list", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps([1, 2] if edit is None else {**good, **edit}))
    from transformers import AutoConfig

    AutoConfig.for_model("mamba", hidden_size=16, num_hidden_layers=1, vocab_size=64).save_pretrained(tmp_path / "mamba")
    return tmp_path


OWN = b'{"text": "a"}\n'  # (a model of one's own needs data of one's own: the bundled samples are the demo's)


@pytest.mark.parametrize("override,code,needles", [
    ("model_name_or_path={t}/missing", 2, ["missing: no such folder", "hf download"]),
    ("model_name_or_path=someorg/some-model", 2, ["no such folder"]),  # not the Hub: refused at once
    ("model_name_or_path={t}/a_file", 2, ["is a file"]),
    ("model_name_or_path={t}/no_config", 2, ["has no config.json"]),
    ("model_name_or_path={t}/gpt2", 2, ["gpt2", "llama"]),
    # (a hand-edited config.json: one line, not an error deep in the planner or transformers)
    ("model_name_or_path={t}/layers0", 2, ["config.json: num_hidden_layers is 0; it must be a whole number >= 1"]),
    ("model_name_or_path={t}/heads3", 2, ["heads3/config.json: transformers cannot read it", "not a multiple of the "
                                          "number of attention heads (3)"]),
    ("model_name_or_path={t}/kv3", 2, ["num_key_value_heads 3 does not divide num_attention_heads 4"]),
    ("model_name_or_path={t}/ffn_neg", 2, ["intermediate_size is -5"]),
    ("model_name_or_path={t}/a_list", 2, ["a_list/config.json: transformers cannot read it"]),
    ("model_name_or_path={t}/mamba", 2, ["model_type 'mamba'"]),  # (no attention heads: not a size to check)
    ("device=tpu", 2, ["device 'tpu' is not supported"]),
    ("max_steps.x=1", 2, ["only offload.<key> is a section"]),
    ("micro_batch_size=2.5", 2, ["micro_batch_size must be a whole number"]),
    ("packing=yes-please", 2, ["packing must be true or false"]),
    ("cutoff_len=100000", 2, ["exceeds the model's max_position_embeddings"]),
    ("learning_rate=[", 2, ["not valid YAML"]),
    ("dataset=[{{format: text}}]", 2, ["dataset[0] has no path"]),
    ("resume_from_checkpoint=/etc", 2, ["/etc/state/trainer.json", "not a complete slideformer checkpoint"]),
    ("resume_from_checkpoint={t}/missing", 2, ["resume_from_checkpoint", "missing: no such folder", "auto (this "
                                             "output_dir's newest) or null"]),
    ("resume_from_checkpoint={t}/gpt2", 2, ["gpt2 holds a model without training state", "model_name_or_path: "]),
    ("resume_from_checkpoint=' '", 2, ["resume_from_checkpoint is empty: set it to auto"]),
    ("save_total_limit=-1", 2, ["save_total_limit must be >= 1"]),
    ("offload.gpu_memory_limit=lots", 2, ["offload.gpu_memory_limit", "24GiB"]),
    ("offload.host_memory_limit=0GiB", 2, ["offload.host_memory_limit", "must be > 0"]),
    ("offload.host_memory_limit=24", 2, ["offload.host_memory_limit", "'24' has no unit", "'24GiB'"]),
    ("offload.host_memory_limit=100TiB", 2, ["offload.host_memory_limit 100TiB is more than this machine's",
                                             "give at most that"]),
    ("offload.gpu_memory_limit=100KB", 2, ["offload.gpu_memory_limit", "'100KB' is under 1 MiB"]),
    ("offload.gpu_memory_limit=1MiB", 3, ["this model needs at least", "over the 1.0 MiB budget",
                                          "raise offload.gpu_memory_limit to"]),  # (the model's floor: no batch)
    ("offload.host_memory_limit=1GiB", 3, ["the process itself takes about 2.0 GiB of host RAM", "more than the "
                                          "1.0 GiB offload.host_memory_limit allows; set it to at least 2.1 GiB"]),
    ("offload.host_memory_limit=2.005GiB", 3, ["host_memory_limit is 2.0 GiB", "process itself",
                                              "offload.host_memory_limit of at least 2.1 GiB, "]),
    ("offload.window_slots=1", 2, ["offload.window_slots must be auto or a number of slots >= 2"]),
    ("offload.window_slots=three", 2, ["offload.window_slots must be auto or a number of slots >= 2, got 'three'"]),
    # (YAML on the command line: a key without the space after its colon, a template that needs quotes)
    ("dataset={{path:{t}/a.jsonl}}", 2, ["YAML reads 'path:", "as one key; write path: ", "a space after the colon"]),
    ("chat_template={{% for m in messages %}}{{% endfor %}}", 2, ["not valid YAML (quote a value with {, ["]),
    ("columns={{text: body}}", 2, ["unknown key columns: it belongs to a dataset's entry", "columns: ...}]"]),
    ("learning_rat=1", 2, ["unknown key learning_rat; did you mean 'learning_rate'?"]),  # (a top-level key, as typed)
    ("dataset=&x [*x]", 2, ["dataset[0] must be a file path or a mapping with a path"]),  # (an alias holding itself)
    ("dataset={{path:hf://org/x}}", 2, ["write path: hf://org/x (a space after the colon)"]),
    ("output_dir=/etc/passwd/run", 2, ["output_dir /etc/passwd/run: /etc/passwd is a file"]),
    ("offload.offload_dir=/etc/passwd", 2, ["offload.offload_dir /etc/passwd is a file"]),
    ("offload.nvme_fraction=1", 2, ["offload.nvme_fraction 1 puts that share", "set offload.offload_dir"]),
    ("num_train_epochs=nan", 2, ["num_train_epochs must be a finite number"]),
    ("num_train_epochs=.inf", 2, ["num_train_epochs must be a finite number"]),
    ("max_grad_norm=.nan", 2, ["max_grad_norm must be a finite number"]),
    ("learning_rate=.inf", 2, ["learning_rate must be a finite number"]),
    ("seed=99999999999999999999999", 2, ["seed must lie in [0, 2**63)"]),
    ("fp8=true", 2, ["fp8: true", "on device cpu", "set fp8: false"]),
    ("fp8=maybe", 2, ["fp8 must be true or false"]),
    ("max_steps=-5", 2, ["max_steps must be > 0, or 0 or -1 for num_train_epochs to decide, got -5"]),
    # (in the trainer's keys: its compute dtype is bf16, not the engine's compute_dtype)
    ("offload.optimizer_state=compact", 2, ["offload.optimizer_state='compact'", "set bf16: true"]),
    ("attn_implementation=flash_attention_2", 2, ["runs on CUDA only"]),  # (before transformers' ImportError)
    ("dataset={t}/data/missing.jsonl", 2, ["dataset file", "data/missing.jsonl does not exist"]),  # not a Hub name
    ("dataset={t}/data/missing.csv", 2, ["dataset file", "data/missing.csv does not exist"]),
    ("eval_dataset={t}/data/missing.jsonl", 2, ["eval_dataset: dataset file", "missing.jsonl does not exist"]),
])
def test_bad_settings(tmp_path, capsys, override, code, needles):
    t = model_dirs(tmp_path)
    own = [f"dataset={data(tmp_path, 'own.jsonl', OWN)}"] * override.startswith("model_name")
    assert main(FAST + [f"output_dir={t}/out", override.format(t=t), *own]) == code
    one_line(capsys, *needles)


def test_resume_from_checkpoint_takes_transformers_spellings(tmp_path, capsys):
    """true (transformers' Trainer's: the newest checkpoint), Auto and None as YAML writes them in another case."""
    from slideformer.train.config import load_config

    assert [load_config(None, [f"resume_from_checkpoint={v}"]).resume_from_checkpoint
            for v in ("true", "false", "Auto", "None", "null", "~/x")] == ["auto", None, "auto", None, None,
                                                                           os.path.expanduser("~/x")]
    out = f"output_dir={tmp_path}/o"
    assert main(FAST + [out, "max_steps=2"]) == 0
    assert main(FAST + [out, "max_steps=3", "resume_from_checkpoint=true"]) == 0
    assert f"resumed from {tmp_path}/o/checkpoint-2 at step 2" in capsys.readouterr().out
    from slideformer.train.config import TrainConfig  # (a library caller's)
    from slideformer.train.loop import train

    r = train(TrainConfig(resume_from_checkpoint=True, output_dir=f"{tmp_path}/o", max_steps=4, device="cpu",
                          progress=False, micro_batch_size=4, max_grad_norm=None).validate())
    assert r["steps"] == 4 and f"resumed from {tmp_path}/o/checkpoint-3" in capsys.readouterr().out


def test_cuda_without_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    assert main(FAST + [f"output_dir={tmp_path}", "device=cuda"]) == 2
    one_line(capsys, "sees no CUDA GPU", "device: cpu")


def test_a_number_for_a_folder_name_is_a_folder_name(tmp_path, monkeypatch):
    from slideformer.train.config import load_config

    assert load_config(None, ["output_dir=123"]).output_dir == "123"


@pytest.mark.parametrize("name,content,needles", [
    ("latin1.jsonl", json.dumps({"text": "caf\u00e9"}, ensure_ascii=False).encode("latin-1") + b"\n", ["latin1.jsonl:1: not UTF-8"]),
    ("gz.jsonl", gzip.compress(b'{"text": "x"}\n'), ["gz.jsonl is compressed"]),
    ("junk.parquet", b"PAR1 not really parquet", ["junk.parquet: not a readable Parquet file"]),
    ("deep.json", b"[" * 100000 + b"]" * 100000, ["deep.json: JSON nested too deeply"]),
    ("deep.jsonl", b"[" * 100000 + b"]" * 100000 + b"\n", ["deep.jsonl:1: not valid JSON (nested too deeply)"]),
    ("broken.jsonl", b'{"text": "ok"}\n{"text": \n', ["broken.jsonl:2: not valid JSON", "skip_bad_records"]),
    ("empty.jsonl", b"\n", ["empty.jsonl holds no records"]),
    ("null.jsonl", b'{"text": "a"}\nnull\n', ["null.jsonl:2: expected a record (a JSON object), got null"]),
    ("null.json", b'[null, {"text": "a"}]', ["null.json[record 0]: expected a record (a JSON object), got null"]),
    ("surrogate.jsonl", b'{"text": "\\ud800 bad"}\n', ["surrogate.jsonl:1: text holds invalid Unicode"]),
    ("records", b'{"text": "a"}\n{"text": "b"}\nnot json\n', ["records:3: not valid JSON", "skip_bad_records"]),
    ("notes.txt", b"plain prose, one paragraph\n", ["notes.txt:1: not valid JSON", "a .txt file is read as JSONL",
                                                   '{"text": ...}']),
    ("quote.csv", b'instruction,output\n"a,b\n', ["quote.csv: datasets cannot read it (ParserError"]),
    ("latin1.csv", b"instruction,output\nh\xff,x\n", ["latin1.csv: datasets cannot read it (UnicodeDecodeError"]),
])
def test_bad_data_files_are_named(tmp_path, capsys, name, content, needles):
    p = data(tmp_path, name, content)
    assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{p}]"]) == 2
    one_line(capsys, *needles)
    assert not (tmp_path / "out").exists()  # refused before the run took its folder


def test_a_byte_order_mark_before_the_first_record_is_not_part_of_it(tmp_path, capsys):
    """(Editors on Windows write one; JSON and JSONL alike.)"""
    from slideformer.data import read_records
    from slideformer.data.lazy import JsonlLines

    recs = [{"text": f"sample number {i}"} for i in range(8)]
    p = data(tmp_path, "bom.jsonl", b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in recs).encode() + b"\n")
    q = data(tmp_path, "bom.json", b"\xef\xbb\xbf" + json.dumps(recs).encode())
    assert [r for _, r in read_records(p)] == [r for _, r in read_records(q)] == recs
    assert JsonlLines(p, skip_bad=False)[0][1] == recs[0]
    assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{p}]"]) == 0


def test_dataset_paths_on_the_command_line_are_from_the_current_folder(tmp_path, monkeypatch):
    """A config file's dataset paths are relative to the file; the command line's to where it runs."""
    from slideformer.train.config import load_config

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.yaml").write_text("model_name_or_path: tiny\ndataset: in_cfg.jsonl\neval_dataset: [held.jsonl]\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config("cfg/run.yaml")
    assert cfg.dataset[0].path == "cfg/in_cfg.jsonl" and cfg.eval_dataset[0].path == "cfg/held.jsonl"
    cfg = load_config("cfg/run.yaml", ["dataset=mine.jsonl"])
    assert cfg.dataset[0].path == "mine.jsonl" and cfg.eval_dataset[0].path == "cfg/held.jsonl"
    # (a Hub dataset's name stays one, and ~ is a home folder, as a shell reads it)
    (tmp_path / "cfg" / "hub.yaml").write_text("model_name_or_path: tiny\ndataset: [org/name, ~/mine.jsonl]\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert [d.path for d in load_config("cfg/hub.yaml").dataset] == ["org/name", str(tmp_path / "home" / "mine.jsonl")]
    # every path key, a file's or the command line's (quoted, or after `=`: a shell may leave ~ as it is)
    home = tmp_path / "home"
    (tmp_path / "cfg" / "all.yaml").write_text("model_name_or_path: ~/m\ndataset: d.jsonl\noutput_dir: ~/o\n"
                                               "offload:\n  offload_dir: ~/nvme\n")
    cfg = load_config("cfg/all.yaml", ["resume_from_checkpoint=~/o/checkpoint-3", "eval_dataset=~/e.jsonl"])
    assert (cfg.model_name_or_path, cfg.output_dir, cfg.offload.offload_dir, cfg.resume_from_checkpoint) == (
        str(home / "m"), str(home / "o"), str(home / "nvme"), str(home / "o" / "checkpoint-3"))
    assert cfg.eval_dataset[0].path == str(home / "e.jsonl") and cfg.dataset[0].path == "cfg/d.jsonl"
    assert load_config(None, ["model_name_or_path=~/m", "dataset=~/d.jsonl"]).dataset[0].path == str(home / "d.jsonl")


def test_resuming_with_other_data_says_so(tmp_path, capsys):
    """A changed seed or batch size continues at the saved position of another order: allowed (a user may
    mean it), said once."""
    out = f"output_dir={tmp_path}/o"
    assert main(FAST + [out, "max_steps=2"]) == 0
    capsys.readouterr()
    assert main(FAST + [out, "max_steps=3", "seed=5", "micro_batch_size=2"]) == 0
    err = capsys.readouterr().err
    assert "resumed with seed 5 (it was 0), batch 2 (it was 4): the data from step 3 on" in err, err
    assert main(FAST + [out, "max_steps=4", "seed=5", "micro_batch_size=2"]) == 0
    assert "the data from" not in capsys.readouterr().err  # (the same as the checkpoint's: nothing to say)


def test_resuming_with_data_changed_in_place_says_so(tmp_path, capsys):
    """The same files with other content (an edit, a shuffle: as many lines), other columns, another chat
    template or val_size: each said on resume, as a changed seed is."""
    lines = (_assets() / "sample" / "alpaca.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "d.jsonl").write_text("".join(lines))
    out, data = f"output_dir={tmp_path}/o", f"dataset={tmp_path}/d.jsonl"
    assert main(FAST + [out, data, "max_steps=2"]) == 0
    capsys.readouterr()
    (tmp_path / "d.jsonl").write_text("".join(lines[1:] + lines[:1]))
    assert main(FAST + [out, data, "max_steps=3"]) == 0
    err = capsys.readouterr().err
    assert "resumed with the dataset's content (a file edited or replaced): the data from step 3 on" in err, err
    assert main(FAST + [out, data, "max_steps=4"]) == 0
    assert "the data from" not in capsys.readouterr().err
    entry = f"dataset=[{{path: {tmp_path}/d.jsonl, columns: {{instruction: output, output: instruction}}}}]"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert main(FAST + [out, entry, "max_steps=5", "val_size=0.1", f"chat_template={tmp_path}/t.jinja"]) == 0
    err = capsys.readouterr().err
    assert ("resumed with samples 79 (it was 88), val_size 0.1 (it was 0.0), a dataset entry's format, split, subset "
            "or columns, the chat template: the data from step 5 on") in err, err


def test_num_train_epochs_resumed_with_another_batch_counts_its_steps_from_the_position_kept(tmp_path, capsys):
    """The epochs a run counts its length in are finished at the new batch: the steps from the saved position
    (20 of 88 samples into epoch 0) to the epoch's end, not the whole epoch's steps over again."""
    data = f"dataset={_assets()}/sample/alpaca.jsonl"
    out = f"output_dir={tmp_path}/o"
    assert main(FAST + [out, data, "cutoff_len=64", "max_steps=5"]) == 0
    capsys.readouterr()
    assert main(FAST + [out, data, "cutoff_len=64", "max_steps=-1", "num_train_epochs=1", "micro_batch_size=8"]) == 0
    err = capsys.readouterr().err
    assert "resumed with steps 13 (it was 5)" in err, err  # (5 + 68 samples // 8)
    # (a dataset smaller than the batch: each step an epoch whole, from epoch 1 on, resumed at any of them)
    from types import SimpleNamespace

    from slideformer.train.loop import _epoch_micro_batches

    small = SimpleNamespace(num_train_epochs=3, packing=False, seed=0)
    assert [_epoch_micro_batches(small, [([1], [1])] * 10, 16, e, o) for e, o in ((0, 0), (1, 10), (3, 10))] == \
        [3, 2, 0]
    rows = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 13 and rows[-1]["epoch"] == pytest.approx(84 / 88), rows[-1]  # (4 short of a batch)


def test_resuming_with_another_optimizer_state_is_refused_in_its_key_before_the_model_loads(tmp_path, capsys,
                                                                                         monkeypatch):
    out = f"output_dir={tmp_path}/o"
    assert main(FAST + [out, "max_steps=2"]) == 0
    capsys.readouterr()
    import slideformer.train.loop as loop

    monkeypatch.setattr(loop.SlideEngine, "from_config", lambda *a: pytest.fail("the model was built"))
    assert main(FAST + [out, "max_steps=3", "bf16=true", "offload.optimizer_state=compact"]) == 2
    one_line(capsys, f"{tmp_path}/o/checkpoint-2 was saved with offload.optimizer_state: fp32, this run has compact: "
             "resume it with offload.optimizer_state: fp32")
    monkeypatch.undo()
    # (what the line offers instead: the checkpoint's weights as a new run's model)
    assert main(FAST + [f"output_dir={tmp_path}/new", "max_steps=1", "bf16=true", "offload.optimizer_state=compact",
                        f"model_name_or_path={tmp_path}/o/checkpoint-2", "resume_from_checkpoint=null",
                        f"dataset={_assets()}/sample/alpaca.jsonl"]) == 0


def test_resuming_with_another_schedule_or_precision_says_so(tmp_path, capsys):
    out = f"output_dir={tmp_path}/o"
    assert main(FAST + [out, "max_steps=2"]) == 0
    capsys.readouterr()
    assert main(FAST + [out, "max_steps=3", "learning_rate=0.5", "max_grad_norm=1.0"]) == 0
    err = capsys.readouterr().err
    assert ("resumed with learning_rate 0.5 (it was 0.003), steps 3 (it was 2), max_grad_norm 1.0 (it was None): "
            "the steps from 3 on follow these") in err, err
    assert "the data from" not in err
    assert main(FAST + [out, "max_steps=3", "learning_rate=0.5", "max_grad_norm=1.0"]) == 0  # (at its end: no step)
    assert main(FAST + [out, "max_steps=4", "learning_rate=0.5", "max_grad_norm=1.0"]) == 0
    assert "resumed with steps 4 (it was 3): the steps from 4 on" in capsys.readouterr().err
    # (more steps: warmup_ratio's steps are of the new count, as transformers' Trainer resumed so takes them)
    assert main(FAST + [out, "max_steps=20", "learning_rate=0.5", "max_grad_norm=1.0"]) == 0
    assert "resumed with steps 20 (it was 4), warmup_steps 2 (it was 1): the steps from 5 on" in \
        capsys.readouterr().err


def test_a_library_run_with_path_datasets_saves_and_resumes_quietly(tmp_path, monkeypatch, capsys):
    """DatasetSpec paths as pathlib.Path (a library caller's), and the same file named from another folder on
    resume: the checkpoint's record of the data is the file's, not its spelling."""
    from slideformer.train.config import DatasetSpec, TrainConfig, _assets
    from slideformer.train.loop import train

    sample = _assets() / "sample" / "alpaca.jsonl"
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "d.jsonl").write_bytes(sample.read_bytes())
    kw = dict(device="cpu", progress=False, micro_batch_size=4, max_grad_norm=None, output_dir=str(tmp_path / "o"))
    assert train(TrainConfig(dataset=[DatasetSpec(tmp_path / "here" / "d.jsonl")], max_steps=2, **kw).validate())[
        "status"] == "finished"
    monkeypatch.chdir(tmp_path / "here")
    capsys.readouterr()
    assert train(TrainConfig(dataset=["./d.jsonl"], max_steps=3, **kw).validate())["steps"] == 3
    assert "the data from" not in capsys.readouterr().err


def test_resuming_an_earlier_checkpoint_into_its_run_is_refused(tmp_path, capsys):
    """Two histories in one folder (the next auto-resume would jump back to the later one): refused, nothing
    touched; the newest one, or another folder, is how."""
    out = tmp_path / "o"
    assert main(FAST + [f"output_dir={out}", "max_steps=3", "save_steps=1", "save_total_limit=null"]) == 0
    before = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main(FAST + [f"output_dir={out}", "max_steps=5", f"resume_from_checkpoint={out}/checkpoint-1"]) == 2
    one_line(capsys, "holds this run's checkpoint-3, past", "checkpoint-1", "resume_from_checkpoint: auto")
    assert sorted(p.name for p in out.iterdir()) == before
    assert main(FAST + [f"output_dir={tmp_path}/branch", "max_steps=2",
                        f"resume_from_checkpoint={out}/checkpoint-1"]) == 0  # (a branch of its own)


def test_skip_bad_records_also_skips_lines_that_are_not_json(tmp_path, capsys):
    lines = [json.dumps({"text": f"sample number {i}"}) for i in range(8)] + ['{"text": ', "not json at all", "null"]
    p = data(tmp_path, "d.jsonl", "\n".join(lines).encode() + b"\n")
    assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{p}]", "skip_bad_records=true"]) == 0
    assert "skipped 3 malformed record(s)" in capsys.readouterr().out


def test_samples_without_a_target_within_cutoff_len_are_counted(tmp_path, capsys):
    long_prompt = {"instruction": "word " * 400, "output": "yes"}
    recs = [long_prompt] * 3 + [{"instruction": "hi", "output": f"answer {i}"} for i in range(8)]
    p = data(tmp_path, "d.jsonl", "\n".join(json.dumps(r) for r in recs).encode() + b"\n")
    assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{p}]", "cutoff_len=64"]) == 0
    assert "3 sample(s) have no target token within cutoff_len 64" in capsys.readouterr().err


def test_val_size_below_one_record_holds_out_one_and_says_so(tmp_path, capsys):
    rows = data(tmp_path, "d.jsonl", b"".join(b'{"text": "sample %d"}\n' % i for i in range(20)))
    assert main(FAST + [f"output_dir={tmp_path}/a", f"dataset=[{rows}]", "val_size=0.01"]) == 0
    assert "val_size 0.01 of 20 records holds out 1 (5.0% of them: at least one)" in capsys.readouterr().err
    assert main(FAST + [f"output_dir={tmp_path}/b", f"dataset=[{rows}]", "val_size=0.1"]) == 0
    assert "holds out" not in capsys.readouterr().err


def test_a_huge_chat_template_is_refused_at_once(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text(json.dumps({"model_name_or_path": "tiny", "chat_template": "{{ messages }}" + " " * (10 << 20),
                             "max_steps": 1, "cutoff_len": 64,
                             "device": "cpu", "progress": False, "output_dir": str(tmp_path / "out")}))
    t0 = time.perf_counter()
    assert main(["train", str(p)]) == 2
    assert time.perf_counter() - t0 < 30
    one_line(capsys, "chat_template is 10.0 MiB", "not a file's contents")


def test_a_chat_template_that_is_not_jinja_is_named_before_any_record(tmp_path, capsys):
    """Compiled up front: the line names the template's file and line, not each record (which, with
    skip_bad_records, would drop every conversation as malformed)."""
    t = tmp_path / "t.jinja"
    t.write_text("{% for m in messages %}{{ m.content }\n")
    rows = data(tmp_path, "chat.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, '
                b'{"role": "assistant", "content": "yo"}]}\n')
    for extra in ([], ["skip_bad_records=true"]):
        assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{rows}]", f"chat_template={t}", *extra]) == 2
        one_line(capsys, f"chat_template {t}: not a valid Jinja template (line 1")
    assert not (tmp_path / "out").exists()


def test_a_chat_template_that_renders_no_content_or_no_generation_prompt_is_said_before_any_record(tmp_path, capsys):
    """A template reading another key than 'content' would train every chat record on its own text: refused
    (with skip_bad_records too). One with an assistant header but no add_generation_prompt branch trains the
    header with each answer: said, and the run goes on."""
    rows = data(tmp_path, "chat.jsonl", b'{"messages": [{"role": "user", "content": "hi"}, '
                b'{"role": "assistant", "content": "yo"}]}\n')
    value = tmp_path / "value.jinja"
    value.write_text("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['value'] }}<|eos|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    for extra in ([], ["skip_bad_records=true"]):
        assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{rows}]", f"chat_template={value}", *extra]) == 2
        one_line(capsys, f"chat_template {value} renders no message's content", "message['content']")
    assert not (tmp_path / "out").exists()
    text = data(tmp_path, "text.jsonl", b'{"text": "no chat here"}\n')  # (data that never renders it: trained)
    assert main(["data", f"dataset=[{text}]", f"chat_template={value}"]) == 0
    nogen = tmp_path / "nogen.jinja"
    nogen.write_text("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|eos|>\n{% endfor %}")
    assert main(["data", f"dataset=[{rows}]", f"chat_template={nogen}", "--samples", "1"]) == 0
    out = capsys.readouterr()
    assert f"chat_template {nogen} puts '<|assistant|>\\n' before an assistant turn's content" in out.err
    assert "[[<|assistant|>\nyo<|eos|>\n]]" in out.out  # (what it says: the header trained)
    # DeepSeek-R1's way: the reasoning cut from every answer, the last too (reasoning data trains without it)
    r1 = tmp_path / "r1.jinja"
    r1.write_text("{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and '</think>' in c "
                  "%}{% set c = c.split('</think>')[-1] %}{% endif %}<|{{ m['role'] }}|>\n{{ c }}<|eos|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    assert main(["data", f"dataset=[{rows}]", f"chat_template={r1}", "--samples", "0"]) == 0
    assert f"chat_template {r1} drops an answer's reasoning (<think>...</think>), even in the last turn" in \
        capsys.readouterr().err
    qwen3 = os.path.join(os.path.dirname(__file__), "data", "qwen3_like.jinja")  # (the last turn's kept: nothing said)
    assert main(["data", f"dataset=[{rows}]", f"chat_template={qwen3}", "--samples", "0"]) == 0
    assert "reasoning" not in capsys.readouterr().err


def test_a_tokenizer_past_the_models_vocabulary_is_named_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A tokenizer with more tokens than the model's embedding (added tokens, no resize): one line naming the
    record, the id and both sizes before any weight is read, skip_bad_records or not; `slideformer data` too."""
    import shutil
    from importlib.resources import files

    from transformers import AutoConfig, AutoModelForCausalLM

    model = tmp_path / "m"
    shutil.copytree(str(files("slideformer") / "assets" / "tiny"), model)
    config = AutoConfig.from_pretrained(model)
    config.vocab_size = 300  # (the tokenizer's 498 ids do not fit)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    capsys.readouterr()
    rows = data(tmp_path, "d.jsonl", b'{"instruction": "hi there", "output": "hello to you"}\n' * 4)
    for extra in ([], ["skip_bad_records=true"]):
        assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{rows}]", f"model_name_or_path={model}",
                            *extra]) == 2
        one_line(capsys, f"{rows}:1: the tokenizer of {model} gives token id", "past the model's vocabulary of "
                 "300", "holds 498 tokens", "resize the model's embeddings")
    assert main(["data", f"dataset=[{rows}]", f"model_name_or_path={model}"]) == 2
    one_line(capsys, "past the model's vocabulary of 300")
    assert not (tmp_path / "out").exists()
    # read as the steps reach it (a dataset larger than its share of RAM): said up front, stopped at the step
    monkeypatch.setattr("slideformer.plan.memory.data_in_ram", lambda *a: False)
    assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{rows}]", f"model_name_or_path={model}"]) == 2
    err = capsys.readouterr().err
    assert "a record that gives one of those ids stops the run when a step reaches it" in err
    assert f"{rows}:1: the tokenizer of {model} gives token id" in err
    # a pad token past it: refused whatever the data
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.pad_token = tok.convert_ids_to_tokens(450)
    tok.save_pretrained(model)
    capsys.readouterr()
    ok = data(tmp_path, "ok.jsonl", b'{"text": "a"}\n')
    assert main(["data", f"dataset=[{ok}]", f"model_name_or_path={model}"]) == 2
    one_line(capsys, f"the tokenizer of {model} pads with", "id 450, past the model's vocabulary of 300")


def test_a_tokenizer_without_an_end_of_text_token_is_named(tmp_path, capsys):
    """A text sample ends with the eos token, and rows are padded with it where no pad token is set."""
    import shutil
    from importlib.resources import files

    from transformers import AutoTokenizer

    model = tmp_path / "m"
    shutil.copytree(str(files("slideformer") / "assets" / "tiny"), model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.eos_token = tok.pad_token = None
    tok.save_pretrained(model)
    rows = data(tmp_path, "d.jsonl", b'{"text": "a"}\n')
    assert main(["data", f"dataset=[{rows}]", f"model_name_or_path={model}"]) == 2
    one_line(capsys, f"model_name_or_path {model}: its tokenizer has no eos_token", "tokenizer_config.json")


@pytest.mark.parametrize("options,needles", [
    (['dataset=""'], ["dataset[0]: path is ''"]),
    (["dataset=[{d}]", 'eval_dataset=""'], ["eval_dataset[0]: path is ''"]),
    (["dataset=[{d}, {d}]"], ["dataset lists", "twice", "list it once"]),
    (["dataset=[{d}, {dot}]"], ["dataset lists", "twice (again as"]),
    (["dataset=[{{path: {d}, columns: {{text: body}}}}, {{path: {dot}, columns: {{text: body}}}}]"],
     ["dataset lists", "read alike"]),
    (["dataset=[{script}]"], ["datasets cannot read it (RuntimeError", "scripts"]),
])
def test_dataset_keys_a_user_gets_wrong(tmp_path, capsys, monkeypatch, options, needles):
    """An empty path (it would read the folder the run starts in), one file listed twice (its records trained
    twice as often, unsaid), a folder of a datasets loading script: each a bad config, one line."""
    d = data(tmp_path, "d.jsonl", b'{"text": "a"}\n')
    (tmp_path / "script").mkdir()
    (tmp_path / "script" / "script.py").write_text("import datasets\n")
    (tmp_path / "script" / "train.jsonl").write_text('{"text": "a"}\n')
    monkeypatch.chdir(tmp_path)
    args = [o.format(d=d, dot="./d.jsonl", script=tmp_path / "script") for o in options]
    assert main(FAST + [f"output_dir={tmp_path}/out", *args]) == 2
    one_line(capsys, *needles)
    assert not (tmp_path / "out").exists()


def test_one_file_read_two_ways_is_two_datasets(tmp_path, capsys):
    """Another format or columns makes other records of one file: not the same file listed twice."""
    d = data(tmp_path, "qa.jsonl", b'{"q": "what is one", "a": "one"}\n{"q": "what is two", "a": "two"}\n')
    forth, back = "{instruction: q, output: a}", "{instruction: a, output: q}"
    assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{{path: {d}, columns: {forth}}}, "
                                                      f"{{path: {d}, columns: {back}}}]"]) == 0


def test_a_tokenizer_whose_extra_ids_the_data_never_gives_trains(tmp_path, capsys):
    """Ids past the vocabulary that no record produces are no error (each sample is checked, not the tokenizer)."""
    import shutil
    from importlib.resources import files

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = tmp_path / "m"
    shutil.copytree(str(files("slideformer") / "assets" / "tiny"), model)
    tok = AutoTokenizer.from_pretrained(model)
    config = AutoConfig.from_pretrained(model)
    tok.add_tokens([f"<extra_{i}>" for i in range(len(tok), config.vocab_size + 8)])  # (ids past 512)
    tok.save_pretrained(model)
    AutoModelForCausalLM.from_config(config).save_pretrained(model)
    sample = files("slideformer") / "assets" / "sample" / "alpaca.jsonl"
    assert main(FAST + [f"output_dir={tmp_path}/out", f"model_name_or_path={model}", f"dataset={sample}"]) == 0


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n", "max_steps: 1\n"])
def test_a_config_that_names_no_model_is_refused_not_taken_for_the_tiny_model(tmp_path, capsys, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    assert main(["train", str(p), "device=cpu", f"output_dir={tmp_path / 'out'}"]) == 2
    one_line(capsys, f"config {p} names no model_name_or_path", "or tiny, the bundled test model")
    assert not (tmp_path / "out").exists()
    assert main(["train", str(p), "device=cpu", "max_steps=1", "progress=false", "model_name_or_path=tiny",
                 f"output_dir={tmp_path / 'out'}"]) == 0  # (named on the command line)


def test_a_config_that_names_no_dataset_is_refused_not_trained_on_the_samples(tmp_path, capsys):
    """A real model with no dataset trained on the bundled sample records, exit 0: refused now (the tiny
    model may take them; a dataset on the command line counts)."""
    from transformers import AutoModelForCausalLM

    from slideformer.presets import preset_config

    from importlib import resources

    from transformers import AutoTokenizer

    model = tmp_path / "model"
    AutoModelForCausalLM.from_config(preset_config("tiny")).save_pretrained(model)
    AutoTokenizer.from_pretrained(str(resources.files("slideformer") / "assets" / "tiny")).save_pretrained(model)
    p = tmp_path / "c.yaml"
    p.write_text(f"model_name_or_path: {model}\nmax_steps: 1\nprogress: false\n")
    capsys.readouterr()  # (the model's writing)
    assert main(["train", str(p), "device=cpu", f"output_dir={tmp_path / 'out'}"]) == 2
    one_line(capsys, f"config {p} names no dataset", "the bundled samples are the demo's alone")
    assert not (tmp_path / "out").exists()
    sample = resources.files("slideformer") / "assets" / "sample" / "text.jsonl"
    assert main(["train", str(p), "device=cpu", f"dataset={sample}", f"output_dir={tmp_path / 'out'}"]) == 0
    p.write_text("model_name_or_path: tiny\nmax_steps: 1\nprogress: false\n")
    assert main(["train", str(p), "device=cpu", f"output_dir={tmp_path / 'tiny'}"]) == 0
    # with no file, a model on the command line starts from the defaults, not the demo's (its learning rate,
    # 3e-3, is the random tiny model's; its folder out/demo it overwrites): a dataset is needed as in a file
    capsys.readouterr()
    assert main(["train", f"model_name_or_path={model}", "device=cpu", f"output_dir={tmp_path / 'cmd'}"]) == 2
    one_line(capsys, "the command names no dataset: add dataset=PATH")
    from slideformer.train.config import TrainConfig, load_config

    own = load_config(None, [f"model_name_or_path={model}", f"dataset={sample}"])
    assert (own.learning_rate, own.max_steps, own.output_dir, own.overwrite_output_dir) == \
        (TrainConfig.learning_rate, TrainConfig.max_steps, TrainConfig.output_dir, False)
    demo = load_config(None, [f"dataset={sample}"])  # (the tiny model: the demo's settings, the data the user's)
    assert (demo.learning_rate, demo.output_dir) == (3e-3, "out/demo")


def test_a_config_that_is_not_utf8_or_cannot_be_read(tmp_path, capsys, monkeypatch):
    """Bytes that are not UTF-8 are a bad config (2); a config the process may not read is a file that
    could not be read (5), as the documented codes say."""
    from pathlib import Path

    p = tmp_path / "c.yaml"
    p.write_bytes(b"max_steps: 1\noutput_dir: caf\xe9\n")
    assert main(["train", str(p)]) == 2
    one_line(capsys, f"config {p} is not UTF-8 text", "save it as UTF-8")
    p.write_text("max_steps: 1\n")
    real = Path.read_text

    def denied(self, *a, **k):
        if self == p:
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", denied)
    assert main(["train", str(p)]) == 5
    one_line(capsys, f"config {p}: cannot read it (Permission denied)", "check its permissions")


def test_a_data_file_the_process_may_not_read_is_an_io_error(tmp_path, capsys, monkeypatch):
    from slideformer.data import formats

    rows = data(tmp_path, "rows.jsonl", b'{"text": "a"}\n')

    def denied(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(formats, "open", denied, raising=False)
    assert main(FAST + [f"output_dir={tmp_path}/out", f"dataset=[{rows}]"]) == 5
    one_line(capsys, f"dataset file {rows}: cannot read it (Permission denied)", "check its permissions")


def test_a_huge_record_costs_no_more_than_cutoff_len(tmp_path):
    """A 20 MB text record is cut before tokenizing: the same ids as the whole text's first cutoff_len."""
    from transformers import AutoTokenizer

    from slideformer.data import render
    from slideformer.train.config import _assets

    tok = AutoTokenizer.from_pretrained(str(_assets() / "tiny"))
    text = "the quick brown fox jumps over the lazy dog; " * 2000
    whole, _ = render(text, tok, "t")
    cut, _ = render(text, tok, "t", cutoff_len=128)
    assert cut[:128] == whole[:128] and len(cut) < len(whole) / 10
    t0 = time.perf_counter()
    render(text * 200, tok, "t", cutoff_len=128)  # ~20 MB
    assert time.perf_counter() - t0 < 5


def test_a_bug_exits_1_with_its_traceback_in_a_log(tmp_path, capsys, monkeypatch):
    """The log goes into output_dir only where a run has marked it its own: a folder the run never took
    stays as it was (and usable)."""
    import tempfile

    from slideformer.train import loop

    def boom(*a, **k):
        raise RuntimeError("an internal invariant broke")

    monkeypatch.setattr(loop, "build_examples", boom)
    assert main(FAST + [f"output_dir={tmp_path}"]) == 1
    line = one_line(capsys, "unexpected RuntimeError: an internal invariant broke", "please report it")
    log = line.split("the full traceback is in ")[1].split(";")[0]
    assert log.startswith(tempfile.gettempdir()) and "boom" in open(log).read()
    assert not list(tmp_path.iterdir())
    monkeypatch.undo()
    assert main(FAST + [f"output_dir={tmp_path}"]) == 0  # the folder was not taken
    monkeypatch.setattr(loop, "_loop", boom)  # a bug once the run owns its folder: the log is there
    assert main(FAST + [f"output_dir={tmp_path}", "max_steps=2"]) == 1
    assert (tmp_path / "slideformer-error.log").is_file() and "boom" in (tmp_path / "slideformer-error.log").read_text()


@pytest.mark.parametrize("raised, code, needles", [
    # (no signal was sent: a KeyboardInterrupt a worker thread raised is a bug, said with its cause)
    (KeyboardInterrupt, 1, ["unexpected RuntimeError: a worker thread (the CPU optimizer, weight loader or disk) "
                            "failed", "(KeyboardInterrupt: )", "please report it"]),
    (MemoryError, 3, ["out of host memory (MemoryError): set offload.host_memory_limit"]),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 70368744177664 bytes."), 3, ["out of host memory (RuntimeError: [enforce fail",
                                                                 "then resume"]),
    (RuntimeError("a kernel's own failure"), 1, ["failed; training state is not consistent (RuntimeError: a "
                                                 "kernel's own failure)"]),
])
def test_a_worker_threads_failure_is_said_with_its_cause(tmp_path, capsys, monkeypatch, raised, code, needles):
    from slideformer.engine import updates

    def boom(*a, **k):
        raise raised

    monkeypatch.setattr(updates, "adamw_update_", boom)
    assert main(FAST + [f"output_dir={tmp_path}", "max_steps=2"]) == code
    one_line(capsys, *needles)


def test_a_full_datasets_cache_is_said_as_the_cache_with_exit_5(tmp_path, capsys, monkeypatch):
    from slideformer.data import formats

    csv = data(tmp_path, "d.csv", b"text\nhello there\n")

    def full(*a, **k):  # (what datasets' builder raises where its cache's disk has no room)
        raise OSError("Not enough disk space. Needed: Unknown size (download: Unknown size, generated: Unknown size")

    monkeypatch.setattr(formats, "_load", full)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    assert main(FAST + [f"output_dir={tmp_path}/o", f"dataset={csv}"]) == 5
    one_line(capsys, f"dataset {csv}: datasets cannot write its cache", "(Not enough disk space)",
             "set HF_DATASETS_CACHE to a writable folder with room")


def test_a_picture_that_cannot_be_drawn_is_said_and_ends_nothing(tmp_path, capsys, monkeypatch):
    from slideformer.train import loop

    def boom(*a, **k):
        raise RuntimeError("matplotlib's own failure")

    monkeypatch.setattr(loop, "_draw_loss", boom)
    assert main(FAST + [f"output_dir={tmp_path}", "max_steps=2"]) == 0
    assert "loss.png not written (RuntimeError: matplotlib's own failure)" in capsys.readouterr().err
    # nor replaces the error that ended the run (a full disk's)
    import errno

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(loop.OutputDir, "log", full)
    assert main(FAST + [f"output_dir={tmp_path}/b", "max_steps=2"]) == 5


def test_a_worker_threads_disk_error_is_an_io_error(tmp_path, capsys, monkeypatch):
    """A full NVMe disk met by the optimizer's disk thread reaches the main thread wrapped; it exits 5 with
    the disk's line, not as a bug."""
    import errno

    from slideformer.host import nvme

    def full(self, *a, **k):
        raise nvme.TierError(errno.ENOSPC, f"offload_dir {self.offload_dir}: No space left on device")

    real = nvme.NvmeTier.write
    monkeypatch.setattr(nvme.NvmeTier, "write", full)
    assert main(FAST + [f"output_dir={tmp_path}/o", f"offload.offload_dir={tmp_path}/nvme", "offload.nvme_fraction=1",
                        "max_steps=3"]) == 5
    one_line(capsys, "No space left on device", "offload_dir", "step 1", "no checkpoint was saved")
    # (where the run saved one, the line names it: what to resume from)

    def full_later(self, *a, **k):
        if (tmp_path / "o2" / "checkpoint-1").is_dir():
            full(self)
        return real(self, *a, **k)

    monkeypatch.setattr(nvme.NvmeTier, "write", full_later)
    assert main(FAST + [f"output_dir={tmp_path}/o2", f"offload.offload_dir={tmp_path}/nvme", "offload.nvme_fraction=1",
                        "max_steps=50", "save_steps=1"]) == 5
    line = capsys.readouterr().err
    assert "No space left on device" in line and f"({tmp_path / 'o2' / 'checkpoint-1'}) is intact" in line


def test_a_tier_larger_than_its_disk_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """train plans the NVMe tier within the free space of offload_dir's disk, as `slideformer plan` does: one
    line with the sizes and the fixes (exit 3) before the model loads, not a full disk at the first
    reservation; a tier that an ended run left there counts as free (it is removed first)."""
    import slideformer.machine
    from slideformer.engine.engine import SlideEngine

    stale = tmp_path / "nvme" / "slideformer-999999999-abcdef123456"
    stale.mkdir(parents=True)
    (stale / "moments.bin").write_bytes(b"x" * 4096)
    monkeypatch.setattr(slideformer.machine, "disk_free", lambda path: 100 * 2**10)
    monkeypatch.setattr(SlideEngine, "from_config", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(FAST + [f"output_dir={tmp_path}/o", f"offload.offload_dir={tmp_path}/nvme", "offload.nvme_fraction=1",
                        "max_steps=1"]) == 3
    one_line(capsys, "the NVMe tier needs about", f"offload.offload_dir {tmp_path}/nvme", "MiB free there",
             "a smaller offload.nvme_fraction")
    assert not stale.exists() and not (tmp_path / "o").exists()


def test_a_run_refused_after_taking_its_folder_leaves_none(tmp_path, capsys, monkeypatch):
    """Refused once the folder is locked and marked (here: the model cannot be built), a new run leaves no
    mark, no lock and no folder it made; in a folder it was allowed to overwrite, no mark either."""
    from slideformer.engine.engine import SlideEngine

    def broken(*a, **k):
        raise ValueError("cannot build")

    monkeypatch.setattr(SlideEngine, "from_config", broken)
    assert main(FAST + [f"output_dir={tmp_path}/new"]) == 1
    assert not (tmp_path / "new").exists()
    (tmp_path / "users").mkdir()
    (tmp_path / "users" / "notes.txt").write_text("mine")
    assert main(FAST + [f"output_dir={tmp_path}/users", "overwrite_output_dir=true"]) == 1
    assert sorted(p.name for p in (tmp_path / "users").iterdir()) == ["notes.txt"]
    capsys.readouterr()


def test_plan_refuses_nonsense(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "-1"])
    assert e.value.code == 2 and "must be a whole number >= 1" in capsys.readouterr().err
    assert main(["plan", "--model", "/nonexistent", "--seq-len", "64", "--batch-size", "1"]) == 2
    one_line(capsys, "not a preset")
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1", "--gpu-memory", "lots"]) == 2
    one_line(capsys, "--gpu-memory", "24GiB")
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1", "--gpu-memory", "0GiB"]) == 2
    one_line(capsys, "--gpu-memory", "must be > 0")
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1", "--gpu-memory", "24"]) == 2
    one_line(capsys, "--gpu-memory", "'24' has no unit; write e.g. '24GiB'")
    assert main(["plan", "--model", "tiny", "--seq-len", "1024", "--batch-size", "1"]) == 2  # (as train: cutoff_len)
    one_line(capsys, "--seq-len 1024 exceeds the model's max_position_embeddings 256")
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1", "--nvme-master",
                 "--disk-space", "1TB"]) == 2
    one_line(capsys, "--nvme-master, --disk-space describe the NVMe tier: give its folder too (--offload-dir)")
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1", "--cpu-memory", "64GiB",
                 "--host-memory-limit", "100GiB"]) == 2
    one_line(capsys, "--host-memory-limit 100GiB is more than the machine's 64.0 GiB of RAM (--cpu-memory)")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert main(["plan", "--model", str(bad), "--seq-len", "64", "--batch-size", "1"]) == 2
    one_line(capsys, f"{bad / 'config.json'}: transformers cannot read it")
    assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1", "--offload-dir", str(bad / "config.json")]) == 2
    one_line(capsys, "--offload-dir", "config.json is a file; give a folder")
    for ram in (["--cpu-memory", "1MiB"], ["--host-memory-limit", "1GiB"]):  # (as train: the process itself counts)
        assert main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "2", "--gpu-memory", "1GiB",
                     *ram]) == 3
        out = capsys.readouterr().out
        assert "does NOT fit host RAM: the process itself takes about 2.0 GiB of host RAM (Python, torch" in out
        assert "largest batch that fits: 0" in out
    t = model_dirs(tmp_path)
    for name, needle in (("layers0", "num_hidden_layers is 0"), ("kv3", "does not divide"),
                         ("heads3", "transformers cannot read it"), ("a_list", "transformers cannot read it")):
        assert main(["plan", "--model", str(t / name), "--seq-len", "64", "--batch-size", "1"]) == 2
        one_line(capsys, needle)
    for flag, value in (("--nvme-fraction", "7"), ("--nvme-fraction", "-3"), ("--max-grad-norm", "nan"),
                        ("--nproc-per-node", "100000")):
        with pytest.raises(SystemExit):
            main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1", flag, value])
        assert "must be" in capsys.readouterr().err


def test_output_read_by_a_reader_that_goes_ends_quietly():
    """`slideformer plan | head -1`: the reader closes the pipe; no "Broken pipe" error line, exit 141 (as a
    shell's tools end on SIGPIPE). The plan's first line says its size in the unit that shows it, and a tiny
    model's plan gives no hint that saves nothing."""
    cmd = [sys.executable, "-m", "slideformer.cli", "plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1",
           "--gpu-memory", "1GiB", "--cpu-memory", "8GiB"]
    lines = subprocess.run(cmd, capture_output=True, text=True, timeout=300).stdout.splitlines()
    assert lines[0].startswith("tiny: 0.80 M params, batch 1 x seq 64"), lines[0]
    assert not [line for line in lines if line.startswith("bound by")]  # (no hint to save nothing: 0.00 s steps)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141 and err == "", err


# -- export ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main(FAST + [f"output_dir={out}", "max_steps=1"]) == 0
    return out / "checkpoint-1"


def test_export_refuses_its_own_source_and_a_full_folder(checkpoint, tmp_path, capsys):
    before = sorted(p.name for p in checkpoint.iterdir())
    assert main(["export", str(checkpoint), str(checkpoint)]) == 2
    one_line(capsys, "overlaps the checkpoint")
    assert main(["export", str(checkpoint), str(checkpoint / "hf")]) == 2
    one_line(capsys, "overlaps the checkpoint")
    assert sorted(p.name for p in checkpoint.iterdir()) == before
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    assert main(["export", str(checkpoint), str(tmp_path / "full")]) == 2
    one_line(capsys, "not empty", "--overwrite")


def test_export_of_a_folder_without_state_checks_its_weights_readable(checkpoint, tmp_path, capsys):
    """No training state, so no checksums (a plain Hugging Face folder, or a checkpoint stripped of it): a
    truncated weight file is refused, naming it, not copied on to fail in transformers."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(checkpoint, bare, ignore=shutil.ignore_patterns("state"))
    assert main(["export", str(bare), str(tmp_path / "ok")]) == 0
    w = bare / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    capsys.readouterr()
    assert main(["export", str(bare), str(tmp_path / "hf")]) == 2
    one_line(capsys, f"cannot read checkpoint shard {w}", "truncated or corrupt?")
    assert not (tmp_path / "hf").exists()


def test_export_overwrite_leaves_no_stale_weights(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-00001-of-00002.safetensors"}}')
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (dst / "notes.txt").write_text("keep")
    assert main(["export", str(checkpoint), str(dst), "--overwrite"]) == 0
    assert not (dst / "model.safetensors.index.json").exists() and not (dst / "model-00001-of-00002.safetensors").exists()
    assert (dst / "notes.txt").read_text() == "keep" and not (dst / "state").exists()
    assert AutoModelForCausalLM.from_pretrained(dst) is not None
    for _ in range(2):  # (rewritten from the state over its own files: they are replaced, not removed as stale)
        assert main(["export", str(checkpoint), str(dst), "--overwrite", "--dtype", "fp32"]) == 0
        assert AutoModelForCausalLM.from_pretrained(dst).dtype == torch.float32


def test_export_writes_files_others_may_read_and_keeps_the_users_tmp_files(checkpoint, tmp_path):
    """Export stages each file under a name no file had: a user's own model.safetensors.tmp stays, the files
    get the umask's mode (as any file a tool writes, readable by a serving container), and a killed export's
    temporary files are cleared by the next."""
    import stat

    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "model.safetensors.tmp").write_text("mine")
    (dst / ".model.safetensors.0123456789ab.tmp").write_bytes(b"a killed export's")
    old = os.umask(0o022)
    try:
        assert main(["export", str(checkpoint), str(dst), "--overwrite"]) == 0
    finally:
        os.umask(old)
    assert (dst / "model.safetensors.tmp").read_text() == "mine"
    assert not (dst / ".model.safetensors.0123456789ab.tmp").exists()
    assert not [p.name for p in dst.iterdir() if p.name.startswith(".")]
    assert {stat.S_IMODE(p.stat().st_mode) for p in dst.iterdir() if p.is_file()} == {0o644}
    old = os.umask(0o002)  # (weights safetensors writes, rewritten in another dtype: a group-writable umask's mode)
    try:
        assert main(["export", str(checkpoint), str(dst), "--overwrite", "--dtype", "fp32"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((dst / "model.safetensors").stat().st_mode) == 0o664
    # (the checkpoint's own files, weights and training state among them, as the suite's umask makes files)
    plain = 0o666 & ~old
    assert {str(p.relative_to(checkpoint)): stat.S_IMODE(p.stat().st_mode) for p in checkpoint.rglob("*")
            if p.is_file()} == {str(p.relative_to(checkpoint)): plain for p in checkpoint.rglob("*") if p.is_file()}


def test_export_on_a_full_disk_leaves_nothing_half_written(checkpoint, tmp_path, capsys, monkeypatch):
    """A copy that runs out of space midway: what the export wrote is removed (a folder it made, too), the
    user's files stay, and the line names the target."""
    import errno
    import shutil

    real, calls = shutil.copyfile, {"n": 0}

    def fills_up(a, b, **k):
        calls["n"] += 1
        if calls["n"] > 2:
            with open(b, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(a))
        return real(a, b, **k)

    monkeypatch.setattr(shutil, "copyfile", fills_up)
    assert main(["export", str(checkpoint), str(tmp_path / "new")]) == 5
    one_line(capsys, f"export to {tmp_path / 'new'} failed (No space left on device)", "left as it was")
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    calls["n"] = 0
    assert main(["export", str(checkpoint), str(mine), "--overwrite"]) == 5
    capsys.readouterr()
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    # over an earlier export: not one of its files replaced (the copies are staged, then renamed together)
    monkeypatch.setattr(shutil, "copyfile", real)
    assert main(["export", str(checkpoint), str(mine), "--overwrite"]) == 0
    for f in mine.iterdir():
        f.write_bytes(b"earlier " + f.name.encode())
    before = {f.name: f.read_bytes() for f in mine.iterdir()}
    monkeypatch.setattr(shutil, "copyfile", fills_up)
    calls["n"] = 0
    assert main(["export", str(checkpoint), str(mine), "--overwrite"]) == 5
    capsys.readouterr()
    assert {f.name: f.read_bytes() for f in mine.iterdir()} == before


def test_a_model_whose_weights_hold_nan_is_named_at_the_first_step(checkpoint, tmp_path, capsys):
    """A model file holding NaN (a broken earlier fine-tune): the first step's loss is NaN before any update,
    so the learning rate is not the fix; the line names the tensor and the model (exit 4)."""
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(hf)]) == 0
    tensors = load_file(hf / "model.safetensors")
    key = sorted(k for k in tensors if ".mlp." in k)[0]
    tensors[key].view(-1)[3] = float("nan")
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    from slideformer.train.config import _assets

    assert main(FAST + [f"output_dir={tmp_path / 'o'}", f"model_name_or_path={hf}", "max_grad_norm=1.0",
                        f"dataset={_assets() / 'sample' / 'alpaca.jsonl'}"]) == 4
    one_line(capsys, "step 1: loss nan", f"before any update: the model's weights hold NaN or infinity ({key}, as "
             f"read from {hf}); nothing was trained")
    assert not (tmp_path / "o").exists()


def _contents(folder):
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("extra", [[], ["--dtype", "fp32"]])
def test_export_that_cannot_replace_a_file_midway_puts_back_what_was_there(checkpoint, tmp_path, capsys, monkeypatch,
                                                                            extra):
    """A file of the target that cannot be replaced (immutable, another user's in a sticky folder), met after
    others were: the ones replaced are put back and the earlier export's stale weights stay, so the folder
    never holds two exports mixed (a loader would take the earlier index's shards); the line names the file."""
    dst = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(dst)]) == 0
    (dst / "model.safetensors").rename(dst / "model-00001-of-00001.safetensors")  # (an earlier, sharded export)
    (dst / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    for f in dst.iterdir():
        if f.name != "model-00001-of-00001.safetensors":
            f.write_bytes(b"earlier " + f.name.encode())
    before = _contents(dst)
    real, victim = os.replace, dst / ("config.json" if extra else "tokenizer_config.json")

    def refused(a, b, *k, **kw):
        if str(b) == str(victim) and str(a).endswith(".tmp"):
            raise PermissionError(1, "Operation not permitted", str(a))
        return real(a, b, *k, **kw)

    monkeypatch.setattr(os, "replace", refused)
    capsys.readouterr()
    assert main(["export", str(checkpoint), str(dst), "--overwrite", *extra]) == 5
    one_line(capsys, f"export to {dst} failed ({victim}: Operation not permitted); {dst} is left as it was")
    assert _contents(dst) == before  # (no staged or set-aside file left either)
    monkeypatch.setattr(os, "replace", real)
    assert main(["export", str(checkpoint), str(dst), "--overwrite", *extra]) == 0
    assert not (dst / "model.safetensors.index.json").exists() and (dst / "model.safetensors").is_file()


def test_a_signal_once_every_file_is_in_place_keeps_the_export(checkpoint, tmp_path, monkeypatch):
    """Past the renames the export is kept: a signal while what they replaced is deleted (a large earlier
    single file) must not undo the new files, which would leave the folder without weights."""
    import signal

    from slideformer.checkpoint import export
    from slideformer.signals import Interrupted

    dst = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(dst)]) == 0
    ref = _contents(dst)
    (dst / "model.safetensors").write_bytes(b"earlier")

    def interrupted(backups):
        assert backups  # (the earlier files, set aside)
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(export, "forget", interrupted)
    assert main(["export", str(checkpoint), str(dst), "--overwrite"]) == 130
    assert {k: v for k, v in _contents(dst).items() if not k.startswith(".")} == ref


@pytest.mark.parametrize("made", [True, False])
def test_a_signal_mid_export_undoes_it(checkpoint, tmp_path, made):
    """SIGTERM while the files are copied, under the command's own handler (which ends start-up at once): the
    export undoes itself (no staged files left, a folder it made removed) and says so, exit 143; the same
    command then runs."""
    dst = tmp_path / "hf"
    if not made:
        dst.mkdir()
        (dst / "notes.txt").write_text("mine")
    script = ("import os, shutil, signal, sys\n"
              "from slideformer import cli\n"
              "real, n = shutil.copyfile, [0]\n"
              "def copy(a, b, **k):\n"
              "    n[0] += 1\n"
              "    if n[0] == 2:\n"
              "        os.kill(os.getpid(), signal.SIGTERM)\n"
              "    return real(a, b, **k)\n"
              "shutil.copyfile = copy\n"
              "sys.argv = ['slideformer', 'export', sys.argv[1], sys.argv[2], '--overwrite']\n"
              "sys.exit(cli.entry())\n")
    r = subprocess.run([sys.executable, "-c", script, str(checkpoint), str(dst)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"SIGTERM: the export stopped; nothing was written ({dst} removed)"
                                                 if made else f"SIGTERM: the export stopped; {dst} is left as it was")
    assert not dst.exists() if made else _contents(dst) == {"notes.txt": b"mine"}
    assert main(["export", str(checkpoint), str(dst), "--overwrite"]) == 0


def test_export_over_a_folder_where_it_writes_a_file_changes_nothing(checkpoint, tmp_path, capsys):
    dst = tmp_path / "hf"
    assert main(["export", str(checkpoint), str(dst)]) == 0
    weights = (dst / "model.safetensors").read_bytes()
    (dst / "tokenizer_config.json").unlink()
    (dst / "tokenizer_config.json").mkdir()
    (dst / "model.safetensors").write_bytes(b"earlier")
    before = sorted(p.name for p in dst.iterdir())
    capsys.readouterr()
    for extra in ([], ["--dtype", "fp32"]):
        assert main(["export", str(checkpoint), str(dst), "--overwrite", *extra]) == 2
        one_line(capsys, f"export target {dst} holds a folder tokenizer_config.json where the export writes a file")
        assert sorted(p.name for p in dst.iterdir()) == before and (dst / "model.safetensors").read_bytes() == b"earlier"
    assert weights != b"earlier"


def test_export_in_another_dtype_on_a_full_disk_says_so_and_leaves_nothing(checkpoint, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own error type, not an OSError: still exit 5, the files the
    export added removed."""
    from safetensors import SafetensorError

    from slideformer.checkpoint import export

    def full(*a, **k):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "
                              "\"No space left on device\" })  os error 28")

    monkeypatch.setattr(export, "save_file", full)
    assert main(["export", str(checkpoint), str(tmp_path / "new"), "--dtype", "bf16"]) == 5
    one_line(capsys, f"export to {tmp_path / 'new'} failed (No space left on device)")
    assert not (tmp_path / "new").exists()


def test_export_in_float16_past_its_range_is_refused_and_leaves_nothing(checkpoint, tmp_path, capsys, monkeypatch):
    """A master value past float16's range would be exported as infinity: refused (exit 4) with the tensor and
    the fix named, and the files the export had copied (the tokenizer) removed, with the folder it made."""
    from slideformer.checkpoint import export

    real = export._StateMasters.unit_params

    def huge(self, unit):
        params = real(self, unit)
        next(iter(params.values())).view(-1)[0] = 1e6
        return params

    monkeypatch.setattr(export._StateMasters, "unit_params", huge)
    assert main(["export", str(checkpoint), str(tmp_path / "new"), "--dtype", "fp16"]) == 4
    one_line(capsys, "in float16 (past float16's range: export in bfloat16 or float32)")
    assert not (tmp_path / "new").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main(["export", str(checkpoint), str(mine), "--overwrite", "--dtype", "fp16"]) == 4
    capsys.readouterr()
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_export_does_not_follow_links_out_of_the_checkpoint(checkpoint, tmp_path, capsys):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (ck / "extra.txt").symlink_to(secret)
    assert main(["export", str(ck), str(tmp_path / "hf")]) == 2
    one_line(capsys, "extra.txt is a link to", "outside the checkpoint")
    assert not (tmp_path / "hf" / "extra.txt").exists()


def test_export_of_a_run_folder_or_a_missing_one_names_what_to_give(checkpoint, tmp_path, capsys):
    assert main(["export", str(checkpoint.parent), str(tmp_path / "hf")]) == 2
    one_line(capsys, f"{checkpoint.parent} is a run's folder", f"the newest: {checkpoint}")
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "hf")]) == 2
    one_line(capsys, "nowhere does not exist", "checkpoint-N")
    assert main(["export", str(tmp_path), str(tmp_path / "hf")]) == 2
    one_line(capsys, "is not a slideformer checkpoint (no config.json)")
    (tmp_path / "slideformer-run.json").write_text("{}")
    assert main(["export", str(tmp_path), str(tmp_path / "hf")]) == 2
    one_line(capsys, "is a run's folder with no checkpoint yet")
    assert not (tmp_path / "hf").exists()


def test_export_refuses_a_checkpoint_without_its_metadata_and_a_file_target(checkpoint, tmp_path, capsys):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    (ck / "state" / "trainer.json").unlink()
    assert main(["export", str(ck), str(tmp_path / "hf")]) == 2
    one_line(capsys, "trainer.json", "not a complete slideformer checkpoint")
    (tmp_path / "f").write_text("x")
    assert main(["export", str(checkpoint), str(tmp_path / "f"), "--overwrite"]) == 2
    one_line(capsys, "is a file")


def test_export_refuses_a_corrupt_checkpoint(checkpoint, tmp_path, capsys):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    with open(ck / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert main(["export", str(ck), str(tmp_path / "hf")]) == 2
    one_line(capsys, "model.safetensors is corrupt")


# -- signals -----------------------------------------------------------------------------------------
def _cli(tmp_path, *args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "slideformer.cli", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)


def _handled(pid: int, signum: int, timeout: float = 30) -> None:
    """Wait until process ``pid`` catches ``signum`` (its SigCgt mask in /proc): a signal sent before the
    interpreter has installed any handler would test Python's start, not ours."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
            if mask >> (signum - 1) & 1:
                return
        except (OSError, StopIteration):
            pass
        time.sleep(0.01)
    pytest.fail(f"process {pid} never caught signal {signum}")


@pytest.mark.parametrize("sig,code", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_signal_during_start_up_ends_the_run_at_once(tmp_path, sig, code):
    import signal

    p = _cli(tmp_path, "progress=false", "device=cpu", "max_steps=100000", f"output_dir={tmp_path}/o")
    _handled(p.pid, signal.SIGTERM)  # (ours: Python catches SIGINT from its own start)
    time.sleep(0.5)  # into the imports
    p.send_signal(getattr(signal, sig))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == code, out
    assert "Traceback" not in out and f"{sig}: stopped before a training step" in out


def test_a_signal_once_the_run_has_its_folder_leaves_the_folder_as_found(tmp_path):
    """SIGTERM while the data is read (the folder taken, marked and locked), under the command's own handler
    (which ends the imports at once): the run raises, so it leaves no folder it made, with the start-up line."""
    script = ("import os, signal, sys, time\n"
              "from slideformer import cli\n"
              "from slideformer.train import loop\n"
              "real = loop.build_examples\n"
              "def slow(*a, **k):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(5)\n"
              "    return real(*a, **k)\n"
              "loop.build_examples = slow\n"
              "sys.argv = ['slideformer', 'train', *sys.argv[1:]]\n"
              "sys.exit(cli.entry())\n")
    r = subprocess.run([sys.executable, "-c", script, "progress=false", "device=cpu", f"output_dir={tmp_path}/o"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "SIGTERM: stopped before a training step had finished; nothing was saved"
    assert not (tmp_path / "o").exists()


def test_a_signal_while_the_main_thread_waits_in_c_for_a_rank_that_never_comes_ends_the_run(tmp_path):
    """WORLD_SIZE, RANK and a port set by hand, the other rank never started: the rendezvous waits inside C++,
    where Python's handler cannot run (it ignored SIGINT and SIGTERM for its 30 minutes). The watcher ends
    the run within its grace, with the line and code; WORLD_SIZE without RANK is refused (exit 2)."""
    import signal
    import socket

    from slideformer.signals import GRACE_S

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    args = [sys.executable, "-m", "slideformer.cli", "train", "progress=false", "device=cpu", f"output_dir={tmp_path}/o"]
    r = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "error: WORLD_SIZE is 2 but RANK is not set: start the ranks with torchrun"), r.stderr
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**env, "RANK": "0", "LOCAL_RANK": "0"}, cwd=tmp_path)
    _handled(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # (until it listens for the other rank: inside the rendezvous)
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    time.sleep(1)
    sent = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 143, out
    assert time.monotonic() - sent < GRACE_S + 10
    assert out.strip().splitlines()[-1].startswith("SIGTERM: stopped at once: the process was inside a call that "
                                                   f"did not return within {GRACE_S:g} s")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("sig,code", [("SIGTERM", 143), ("SIGHUP", 129)])
def test_a_signal_while_training_saves_the_step_and_exits_128_plus_it(tmp_path, sig, code):
    """(SIGHUP with the output a pipe, or a terminal still there: as SIGTERM.)"""
    import signal

    p = _cli(tmp_path, "progress=false", "device=cpu", "max_steps=100000", "logging_steps=1", "micro_batch_size=2",
             f"output_dir={tmp_path}/o")
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith("step 2/"):
            p.send_signal(getattr(signal, sig))
            break
    out = "".join(seen) + p.communicate(timeout=120)[0]
    assert p.returncode == code, out
    saved = [d for d in (tmp_path / "o").glob("checkpoint-*")]
    assert len(saved) == 1 and (saved[0] / "state" / "trainer.json").is_file(), out
    assert f"{sig}: stopped after step" in out and "Traceback" not in out


@pytest.mark.parametrize("progress", ["false", "true"])  # (plain lines each step; rich's bar, from its thread)
def test_a_terminal_that_hangs_up_mid_training_still_gets_the_step_saved(tmp_path, progress):
    """An ssh session that drops: the terminal hangs up (its writes fail with EIO from then on), then SIGHUP
    comes. The run must not die on its next progress line before the save; it saves and exits 129."""
    import select
    import signal

    try:
        master, slave = os.openpty()
    except OSError:
        pytest.skip("no pseudo-terminal here")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "o"
    p = subprocess.Popen([sys.executable, "-m", "slideformer.cli", "train", f"progress={progress}", "device=cpu",
                          "max_steps=100000", "logging_steps=1", "micro_batch_size=2", f"output_dir={out}"],
                         stdin=slave, stdout=slave, stderr=slave, env=env, cwd=tmp_path)
    os.close(slave)
    deadline = time.monotonic() + 120

    def steps() -> int:
        try:
            return len((out / "metrics.jsonl").read_text().splitlines())
        except OSError:
            return 0
    try:  # (the terminal read as the run writes it, until two steps are logged)
        while steps() < 2 and time.monotonic() < deadline and p.poll() is None:
            if select.select([master], [], [], 0.1)[0]:
                os.read(master, 65536)
    finally:
        os.close(master)  # the hangup: the child's terminal is gone
    assert steps() >= 2 and p.poll() is None
    time.sleep(0.3)  # (progress written into the dead terminal before the signal, as with a shell's SIGHUP)
    p.send_signal(signal.SIGHUP)
    assert p.wait(timeout=120) == 129
    saved = list(out.glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "state" / "trainer.json").is_file()
    assert not (out / "slideformer-error.log").exists()


def test_sighup_is_taken_only_from_its_default():
    """Ignored (nohup: asked to outlive the terminal) or a library caller's own handler (a service's reload):
    left as it is. SIGTERM is taken either way."""
    import signal

    from slideformer.signals import Signals

    def reload(*a):
        pass

    before = signal.getsignal(signal.SIGHUP)
    try:
        for theirs in (signal.SIG_IGN, reload):
            signal.signal(signal.SIGHUP, theirs)
            with Signals() as s:
                assert signal.getsignal(signal.SIGHUP) is theirs
                assert signal.getsignal(signal.SIGTERM) == s._on_signal
            assert signal.getsignal(signal.SIGHUP) is theirs
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with Signals() as s:
            assert signal.getsignal(signal.SIGHUP) == s._on_signal
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_swallowed_interrupt_during_start_up_still_stops_the_run(tmp_path, monkeypatch, capsys):
    """A library that catches KeyboardInterrupt (and carries on) cannot make the run ignore Ctrl-C."""
    import signal

    from slideformer.train import loop

    real = loop.build_examples

    def swallowing(*a, **k):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        return real(*a, **k)

    monkeypatch.setattr(loop, "build_examples", swallowing)
    assert main(FAST + [f"output_dir={tmp_path}", "max_steps=50"]) == 130
    assert not list(tmp_path.glob("checkpoint-*"))


def test_a_signal_that_lands_in_a_finalizer_stops_the_run_after_it(capsys):
    """The handler's raise inside an object's __del__ (the collector's, anywhere) cannot propagate: Python
    printed a traceback and went on as if no signal had come (a rank the launcher ended after another rank's
    error). It is raised again just after, with no traceback; the hook is the interpreter's again after."""
    import signal

    from slideformer.signals import Interrupted, Signals

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)

    hook = sys.unraisablehook
    with pytest.raises(Interrupted) as e:
        with Signals():
            Dropped()
            time.sleep(2)
    assert e.value.signum == signal.SIGTERM and "Traceback" not in capsys.readouterr().err
    assert sys.unraisablehook is hook


def test_the_signal_handler_is_released_after_a_run(tmp_path):
    """One handler per process, shared by nested users, gone when the outermost one ends."""
    import signal

    from slideformer.signals import Signals

    before = signal.getsignal(signal.SIGINT)
    with Signals() as outer:
        with Signals() as inner:
            assert inner is outer
        assert Signals._active is outer
    assert Signals._active is None and signal.getsignal(signal.SIGINT) is before
    assert main(FAST + [f"output_dir={tmp_path}"]) == 0
    assert Signals._active is None and signal.getsignal(signal.SIGINT) is before
    # a run in a worker thread that outlives the main thread's: the caller's handlers come back with the
    # main thread's end, and the next run takes its own (not the stale one's signal)
    import threading

    main_entry, worker_in, worker_out = Signals(), threading.Event(), threading.Event()

    def worker():
        with Signals():
            worker_in.set()
            worker_out.wait(10)

    main_entry.__enter__()
    t = threading.Thread(target=worker)
    t.start()
    worker_in.wait(10)
    main_entry.requested = signal.SIGINT  # (a signal the main thread's run took)
    main_entry.__exit__(None, None, None)
    assert Signals._active is None and signal.getsignal(signal.SIGINT) is before
    worker_out.set()
    t.join()
    assert Signals._active is None and signal.getsignal(signal.SIGINT) is before
    with Signals() as fresh:
        assert fresh is not main_entry and fresh.requested is None


def test_a_library_threads_failure_prints_no_traceback(tmp_path, capsys, monkeypatch):
    """(TensorBoard's writer thread on a full disk printed its traceback among the run's lines.)"""
    import threading

    from slideformer.train import loop

    real = loop.build_examples

    def with_a_failing_thread(*a, **k):
        t = threading.Thread(target=lambda: (_ for _ in ()).throw(OSError(28, "No space left on device")))
        t.start()
        t.join()
        return real(*a, **k)

    monkeypatch.setattr(loop, "build_examples", with_a_failing_thread)
    assert main(FAST + [f"output_dir={tmp_path}"]) == 0
    assert "Traceback" not in capsys.readouterr().err
