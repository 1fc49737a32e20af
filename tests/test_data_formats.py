"""Each data format renders with the loss on the right tokens; bad records are named by file and line."""
import json

import pytest
from transformers import AutoTokenizer

from slideformer.data import DataError, detect_format, read_records, render, to_messages
from slideformer.train.config import _assets


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(_assets() / "tiny"))


def trained_text(tok, rec, fmt="auto"):
    fmt = detect_format(rec, "t") if fmt == "auto" else fmt
    ids, labels = render(to_messages(rec, fmt, "t"), tok, "t")
    assert len(ids) == len(labels)
    return tok.decode([i for i, l in zip(ids, labels) if l != -100])


@pytest.mark.parametrize("rec,expect", [
    ({"instruction": "Add", "input": "2 and 3", "output": "five"}, "five<|eos|>"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                        {"from": "human", "value": "bye"}, {"from": "gpt", "value": "ciao"}]}, "hello<|eos|>ciao<|eos|>"),
    ({"messages": [{"role": "system", "content": "be kind"}, {"role": "user", "content": "q"},
                   {"role": "assistant", "content": "answer"}]}, "answer<|eos|>"),
    ({"text": "all of it counts"}, "all of it counts<|eos|>"),
])
def test_formats_mask_everything_but_the_targets(tok, rec, expect):
    assert trained_text(tok, rec) == expect


def test_prompt_tokens_are_present_but_not_trained(tok):
    ids, labels = render(to_messages({"instruction": "What is 2 plus 2?", "output": "4"}, "alpaca", "t"), tok, "t")
    assert "What is 2 plus 2?" in tok.decode(ids)
    assert labels[0] == -100 and labels[-1] == ids[-1]


def test_malformed_line_names_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "ok"}) + "\n" + '{"text": "broken"\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        read_records(f)


@pytest.mark.parametrize("rec,match", [
    ({"instruction": "x"}, "cannot tell the format"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "turn 0 needs 'from'"),
    ({"messages": [{"role": "user", "content": 3}]}, "message 0 needs"),
])
def test_bad_records(rec, match):
    with pytest.raises(DataError, match=match):
        to_messages(rec, detect_format(rec, "f.jsonl:7"), "f.jsonl:7")


def test_json_and_parquet_files(tmp_path):
    recs = [{"text": "a"}, {"text": "b"}]
    (tmp_path / "d.json").write_text(json.dumps(recs))
    assert [r for _, r in read_records(tmp_path / "d.json")] == recs
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(recs).to_parquet(str(tmp_path / "d.parquet"))
    where, rec = read_records(tmp_path / "d.parquet")[1]
    assert rec == {"text": "b"} and where.endswith("[record 1]")
