"""Datasets read as the steps reach them (data/lazy.py): the records, samples and training of tokenizing up
front, in bounded RAM."""
import json
import os

import pytest

from slideformer.data import NOT_JSON, DataError, read_records
from slideformer.data import lazy
from slideformer.data.lazy import JsonlLines, open_records
from slideformer.plan import memory

from test_train import cfg, train


def records(seq):
    return [seq[i] for i in range(len(seq))]


def test_jsonl_lines_are_the_records_read_up_front(tmp_path, monkeypatch):
    """Line ends across the scan's chunks, blank lines, CRLF, multi-byte text, no newline at the end."""
    monkeypatch.setattr(lazy, "CHUNK", 7)
    f = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": "é" * i}, ensure_ascii=False) for i in range(5)]
    f.write_bytes(("\n".join(lines[:2]) + "\n\n  \r\n" + "\r\n".join(lines[2:])).encode())
    got = records(JsonlLines(f, skip_bad=False))
    assert got == read_records(f) and len(got) == 5 and got[4] == (f"{f}:7", {"text": "éééé"})
    for text in (b"", b"\n \n\t\r\n  ", b'{"text": "a"}\n\n  \n{"text": "b"}\n \n',  # (blank lines are no record)
                 b'{"text": "a"}\n\x0c\x0b\n{"text": "b"}\n'):  # (form feeds: blank, and not JSON after a record)
        (tmp_path / "e.jsonl").write_bytes(text)
        assert records(JsonlLines(tmp_path / "e.jsonl", False)) == read_records(tmp_path / "e.jsonl")
    (tmp_path / "e.jsonl").write_bytes('{"text": "a"}\n\u00a0\n'.encode())  # (non-ASCII space: a line, not JSON)
    assert records(JsonlLines(tmp_path / "e.jsonl", True)) == read_records(tmp_path / "e.jsonl", skip_bad=True)
    assert len(read_records(tmp_path / "e.jsonl", skip_bad=True)) == 2


def test_a_bad_line_is_named_when_a_step_reaches_it(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "ok"}) + "\n" + '{"text": "broken"\n' + json.dumps({"text": "ok"}) + "\n")
    lines = JsonlLines(f, skip_bad=False)
    assert lines[2] == (f"{f}:3", {"text": "ok"})
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON .* skip_bad_records"):
        lines[1]
    assert JsonlLines(f, skip_bad=True)[1] == (f"{f}:2", NOT_JSON)
    f.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not UTF-8"):
        JsonlLines(f, skip_bad=True)[1]


def test_parquet_and_datasets_folders_are_read_by_row(tmp_path):
    from datasets import Dataset

    recs = [{"text": f"s{i}"} for i in range(5)]
    Dataset.from_list(recs).to_parquet(str(tmp_path / "d.parquet"))
    Dataset.from_list(recs).save_to_disk(str(tmp_path / "saved"))
    for name in ("d.parquet", "saved"):
        rows = open_records(tmp_path / name)
        assert [rows[i] for i in range(len(rows))] == read_records(tmp_path / name)


@pytest.mark.parametrize("name,opener", [("d.jsonl.gz", "gzip"), ("d.json.bz2", "bz2"), ("d.ndjson.xz", "lzma")])
def test_compressed_json_files_read_as_the_files_they_hold(tmp_path, name, opener):
    """train.jsonl.gz (as the Hub holds many datasets) reads, up front and as reached, as the file it holds
    does: the same records (no type guessed: a date stays text), the same lines named and skipped; where
    the records are counted, it holds up to COMPRESSED_TEXT times its size. A file that does not decompress
    is named; a compressed file under a plain name is refused with the names that read."""
    import importlib

    recs = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(5)] + [{"instruction": "2024-01-01",
                                                                              "output": 4}]
    text = json.dumps(recs) if ".json." in name else "".join(json.dumps(r) + "\n" for r in recs)
    with importlib.import_module(opener).open(tmp_path / name, "wt") as f:
        f.write(text)
    plain = tmp_path / name.rsplit(".", 1)[0]
    plain.write_text(text)
    assert read_records(tmp_path / name) == [(w.replace(plain.name, name), r) for w, r in read_records(plain)]
    assert [r for _, r in read_records(tmp_path / name)] == recs
    rows = open_records(tmp_path / name)
    assert [rows[i][1] for i in range(len(rows))] == recs
    if ".json." not in name:  # (a line that is not JSON: skipped as a plain file's is)
        with importlib.import_module(opener).open(tmp_path / name, "wt") as f:
            f.write(text + "{not json\n")
        assert read_records(tmp_path / name, skip_bad=True)[-1] == (f"{tmp_path / name}:7", NOT_JSON)
    (tmp_path / "cut.jsonl.gz").write_bytes((tmp_path / name).read_bytes()[:20])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: cannot decompress it"):
        read_records(tmp_path / "cut.jsonl.gz")
    import gzip  # (a damaged deflate stream: zlib's error, named the same way)
    damaged = bytearray(gzip.compress("".join(json.dumps(r) + "\n" for r in recs * 40).encode()))
    damaged[20:60] = bytes(40)
    (tmp_path / "bad.jsonl.gz").write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz: cannot decompress it"):
        read_records(tmp_path / "bad.jsonl.gz")


def test_json_lines_under_a_json_name_read_as_lines(tmp_path):
    """A .json file (or .json.gz: the Hub's C4 shards) holding a JSON record a line reads as JSONL, as datasets
    reads it: up front and as reached, compressed or not."""
    import gzip

    recs = [{"text": f"line {i}"} for i in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    (tmp_path / "d.json").write_text(text)
    (tmp_path / "d.json.gz").write_bytes(gzip.compress(text.encode()))
    for name in ("d.json", "d.json.gz"):
        assert read_records(tmp_path / name) == [(f"{tmp_path / name}:{i + 1}", r) for i, r in enumerate(recs)]
        rows = open_records(tmp_path / name)
        assert [rows[i][1] for i in range(len(rows))] == recs
    (tmp_path / "obj.json").write_text('{"text": "one object"} trailing')
    with pytest.raises(DataError, match=r"obj\.json:1: not valid JSON \(Extra data\)"):
        read_records(tmp_path / "obj.json")
    assert lazy.source_bytes(tmp_path / name) == lazy.COMPRESSED_TEXT * (tmp_path / name).stat().st_size
    (tmp_path / name).rename(tmp_path / "d.jsonl")
    with pytest.raises(DataError, match=r"d\.jsonl is compressed .* read compressed under their names: "
                                        r"train\.jsonl\.gz"):
        read_records(tmp_path / "d.jsonl")


@pytest.mark.parametrize("extra", [[], ["packing=true", "cutoff_len=96", "micro_batch_size=2"]])
def test_training_on_data_read_as_reached_is_training_on_it_tokenized_up_front(tmp_path, monkeypatch, capsys, extra):
    """Over an epoch's end, with held-out evaluation, and resumed mid-way: the same losses, bit for bit."""
    opts = ["max_steps=24", "val_size=0.1", "eval_steps=12", "save_steps=12", "save_total_limit=5", *extra]
    up = train(cfg(tmp_path / "up", *opts))
    assert "read as the steps reach it" not in capsys.readouterr().out
    monkeypatch.setattr(memory, "DATA_RAM_SHARE", 0.0)  # (the bundled data then counts as large)
    reached = train(cfg(tmp_path / "lazy", *opts))
    assert "read as the steps reach it" in capsys.readouterr().out
    assert [h["loss"] for h in reached["history"]] == [h["loss"] for h in up["history"]]
    assert reached["evals"] == up["evals"] and len(up["evals"]) == 2
    import shutil

    shutil.rmtree(tmp_path / "lazy" / "checkpoint-24")  # a crash after step 12
    again = train(cfg(tmp_path / "lazy", *opts, "resume_from_checkpoint=auto"))
    assert [h["loss"] for h in again["history"]] == [h["loss"] for h in up["history"]][12:]


def test_records_that_are_no_sample_are_counted_once_when_met(tmp_path, monkeypatch, capsys):
    """A line that is not JSON, a malformed record, one with no target within cutoff_len and a blank line,
    under skip_bad_records over two epochs: the same training as tokenizing up front (the order is the
    records', those that are no sample passed over), each counted once."""
    d = tmp_path / "d.jsonl"
    d.write_text("\n".join([json.dumps({"text": f"sample {i}"}) for i in range(8)]
                           + ['{"text": "broken', json.dumps({"conversations": [{"from": "alien", "value": "x"}]}),
                              "   ", json.dumps({"instruction": "word " * 60, "output": "x"}),
                              json.dumps({"text": "word " * 60})]) + "\n")
    opts = [f"dataset=[{d}]", "skip_bad_records=true", "cutoff_len=32", "max_steps=8", "micro_batch_size=2"]
    up = train(cfg(tmp_path / "up", *opts))
    monkeypatch.setattr(memory, "DATA_RAM_SHARE", 0.0)
    reached = train(cfg(tmp_path / "lazy", *opts))
    assert (up["skipped_records"], up["dropped_samples"]) == (2, 1)
    assert (reached["skipped_records"], reached["dropped_samples"], reached["dropped_as_met"]) == (2, 1, 1)
    assert reached["truncated_as_met"] == 1 and "truncated_as_met" in up and not up["truncated_as_met"]
    assert train(cfg(tmp_path / "val", *opts, "val_size=0.2"))["truncated_as_met"] == 1  # (through val_size's split)
    assert [h["loss"] for h in reached["history"]] == [h["loss"] for h in up["history"]] and reached["steps"] == 8
    # held out and read as reached, they are left out of evaluation as when tokenized up front (a copy: the
    # training file itself is refused as eval_dataset)
    e = tmp_path / "e.jsonl"
    e.write_text(d.read_text())
    held = train(cfg(tmp_path / "held", *opts, f"eval_dataset=[{e}]"))
    monkeypatch.undo()
    capsys.readouterr()
    held_up = train(cfg(tmp_path / "held_up", *opts, f"eval_dataset=[{e}]"))
    (a,), (b,) = held["evals"], held_up["evals"]
    assert a["eval_tokens"] == b["eval_tokens"] == 33 + 31 and a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6)
    assert "eval_dataset: 2 record(s) skipped as malformed, 1 with no target token within cutoff_len; left out " \
        "of evaluation" in capsys.readouterr().err


def test_a_dataset_larger_than_its_share_of_ram_is_read_in_bounded_ram(tmp_path):
    """96 MiB of JSONL would take about 1.6 GiB tokenized up front; read as reached, RAM holds its index (8
    bytes a line, a byte a record met, the order's 8): a few MiB, however many steps are drawn."""
    from slideformer.train.loop import _draw, _permutation, build_examples, load_tokenizer
    from slideformer.watchdog import rss_bytes

    f = tmp_path / "big.jsonl"
    line = json.dumps({"instruction": "add " * 40, "output": "sum " * 40}) + "\n"
    with open(f, "w") as out:
        out.write(line * (96 * 2**20 // len(line)))
    assert not memory.data_in_ram(f.stat().st_size, 16 * 2**30)  # (a 16 GiB allowance: its 5% is 0.8 GiB)
    c = cfg(tmp_path / "o", f"dataset=[{f}]", "cutoff_len=256")
    tok = load_tokenizer(c)
    before = rss_bytes()
    examples, *_ = build_examples(c, tok, None, lazy=True)
    order, offset = _permutation(len(examples), 0, 0), 0
    for _ in range(50):
        mb, offset, _ = _draw(examples, order, offset, 8, False, 256, tok.pad_token_id)
    assert mb["input_ids"].shape[0] == 8 and offset == 400
    assert rss_bytes() - before < 64 * 2**20  # (about 23 MiB: the index and the scan's buffers)


def test_an_epoch_is_the_samples_and_held_out_data_without_one_is_said(tmp_path, capsys):
    """Tokenized up front, num_train_epochs counts the samples, not the records that are no sample; a
    val_size that leaves no sample to train on, and held-out data with none, are said in one line."""
    from slideformer.data import DataError

    d = tmp_path / "d.jsonl"
    good = [json.dumps({"text": f"sample {i}"}) for i in range(8)]
    bad = [json.dumps({"instruction": "word " * 60, "output": "x"})] * 8  # (no target within cutoff_len)
    d.write_text("\n".join(good + bad) + "\n")
    r = train(cfg(tmp_path / "o", f"dataset=[{d}]", "cutoff_len=32", "micro_batch_size=2", "num_train_epochs=1",
                  "max_steps=-1"))
    assert r["steps"] == 4 and all(0 < h["epoch"] <= 1 for h in r["history"])
    import torch

    from slideformer.train.loop import VAL_SPLIT_SEED

    first = int(torch.randperm(2, generator=torch.Generator().manual_seed(VAL_SPLIT_SEED))[0])  # (the one held out)
    v = tmp_path / "v.jsonl"
    v.write_text("\n".join([good[0], bad[0]] if first == 0 else [bad[0], good[0]]) + "\n")
    with pytest.raises(DataError, match="val_size 0.5 leaves no sample to train on"):
        train(cfg(tmp_path / "v", f"dataset=[{v}]", "cutoff_len=32", "max_steps=1", "val_size=0.5"))
    only_bad = tmp_path / "b.jsonl"
    only_bad.write_text("\n".join(bad[:2]) + "\n")
    capsys.readouterr()
    r = train(cfg(tmp_path / "e", f"dataset=[{d}]", "cutoff_len=32", "max_steps=2", f"eval_dataset=[{only_bad}]"))
    assert r["steps"] == 2 and r["evals"] == []
    assert "no held-out record is a sample" in capsys.readouterr().err


def test_a_bad_record_of_an_eval_dataset_read_as_reached_stops_the_run_before_training(tmp_path, monkeypatch):
    """Every evaluation reads eval_dataset whole: read as reached, its records are still checked at the start,
    not first at an evaluation after hours of training."""
    bad = tmp_path / "val.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    monkeypatch.setattr(memory, "DATA_RAM_SHARE", 0.0)
    with pytest.raises(DataError, match=r"val.jsonl:2: not valid JSON"):
        train(cfg(tmp_path / "run", "max_steps=2", f"eval_dataset={bad}"))
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_a_parquet_files_size_is_what_it_holds_uncompressed(tmp_path):
    """Whether a dataset is tokenized up front is judged from the bytes its records hold: a Parquet file of
    text is a fraction of them on disk (its footer's uncompressed sizes say) (a folder of them alike); a file not Parquet inside is its
    size (reading it says what is wrong)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    r = random.Random(0)
    words = "alpha beta gamma delta river stone light eleven under quiet".split()
    table = pa.table({"text": [" ".join(r.choice(words) for _ in range(200)) for _ in range(2000)]})  # (2.4 MB)
    (tmp_path / "d").mkdir()
    pq.write_table(table, tmp_path / "d" / "a.parquet", compression="zstd")
    on_disk = (tmp_path / "d" / "a.parquet").stat().st_size
    assert on_disk < 600_000 and lazy.source_bytes(tmp_path / "d" / "a.parquet") >= 2_300_000
    assert lazy.source_bytes(tmp_path / "d") >= 2_300_000
    (tmp_path / "bad.parquet").write_text("not parquet")
    assert lazy.source_bytes(tmp_path / "bad.parquet") == len("not parquet")


def test_a_file_changed_while_the_run_reads_it_is_refused(tmp_path):
    """Read as reached, a record is found where its line started when the file was counted: a file edited or
    appended to since would give other records (or half lines), so the next read refuses, naming the file."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "one"}\n{"text": "two"}\n')
    lines = JsonlLines(f, False)
    assert lines[1][1] == {"text": "two"}
    with open(f, "a") as out:
        out.write('{"text": "three"}\n')
    with pytest.raises(DataError, match=r"d.jsonl changed while the run read it .* put the file back"):
        lines[0]
    f.write_text('{"text": "uno"}\n{"text": "dos"}\n')  # (the same size: its time tells)
    os.utime(f, ns=(lines.stamp[1] + 10**9, lines.stamp[1] + 10**9))
    with pytest.raises(DataError, match="changed while the run read it"):
        lines[1]
