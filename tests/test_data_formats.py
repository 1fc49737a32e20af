"""Each data format renders with the loss on the right tokens; bad records are named by file and line."""
import json
import re

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
    # TRL's prompt-completion: plain text trained past the prompt; conversational, the completion's turns only
    ({"prompt": "Add 2 and 3 =", "completion": " five"}, " five<|eos|>"),
    ({"prompt": "Answer: ", "completion": "blue"}, " blue<|eos|>"),  # (the prompt's last token merges into it)
    ({"prompt": [{"role": "system", "content": "terse"}, {"role": "user", "content": "2+3?"},
                 {"role": "assistant", "content": "in the prompt"}, {"role": "user", "content": "so?"}],
      "completion": [{"role": "assistant", "content": "five"}]}, "five<|eos|>"),
    # OpenAI's fine-tuning format: an assistant message of weight 0 is context
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "BAD ANSWER", "weight": 0},
                   {"role": "user", "content": "again"}, {"role": "assistant", "content": "good", "weight": 1}]},
     "good<|eos|>"),
    # LLaMA-Factory's alpaca history: earlier [instruction, answer] turns, trained as its multi-turn records are
    ({"instruction": "and 3?", "output": "three", "history": [["say 1", "one"]]}, "one<|eos|>three<|eos|>"),
    # (read through Arrow, every message of a struct column has each key: a weight of None is none given)
    ({"messages": [{"role": "user", "content": "q", "weight": None}, {"role": "assistant", "content": "a",
                                                                      "weight": None}]}, "a<|eos|>"),
    # (a weight read as a float, 0.0 or 1.0, as pandas gives a column with gaps)
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "no", "weight": 0.0},
                   {"role": "user", "content": "again"}, {"role": "assistant", "content": "yes", "weight": 1.0}]},
     "yes<|eos|>"),
])
def test_formats_mask_everything_but_the_targets(tok, rec, expect):
    assert trained_text(tok, rec) == expect


def test_text_gets_the_tokenizers_own_special_tokens_and_one_eos():
    """Text is tokenized as transformers' run_clm and TRL do, with the tokenizer's special tokens (Llama 3's
    and Gemma's BOS: without it their pretrained models start from a state they never saw), then the EOS."""
    import copy

    from tokenizers.processors import TemplateProcessing

    plain = AutoTokenizer.from_pretrained(str(_assets() / "tiny"))
    bos = copy.deepcopy(plain)
    bos._tokenizer.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos.bos_token_id)])
    ids, labels = render("all of it", bos, "t")
    assert ids[0] == bos.bos_token_id and ids[1:] == render("all of it", plain, "t")[0] and labels == ids
    both = copy.deepcopy(plain)  # (a tokenizer that ends text with its EOS itself: not a second one)
    both._tokenizer.post_processor = TemplateProcessing(single="$A <|eos|>", special_tokens=[("<|eos|>", both.eos_token_id)])
    assert render("all of it", both, "t")[0] == render("all of it", plain, "t")[0]


def test_a_sharegpt_records_top_level_system_prompt_is_its_first_turn(tok):
    conv = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    with_system = to_messages({"conversations": conv, "system": "be brief"}, "sharegpt", "t")
    assert with_system[0] == {"role": "system", "content": "be brief"} and len(with_system) == 3
    assert "be brief" in tok.decode(render(with_system, tok, "t")[0])
    own = [{"from": "system", "value": "mine"}] + conv  # (a system turn of its own: that one stands)
    assert [m["content"] for m in to_messages({"conversations": own, "system": "other"}, "sharegpt", "t")] == \
        ["mine", "q", "a"]


def test_a_conversation_the_template_cannot_render_is_a_bad_record(tok):
    """An assistant turn first (no template renders the empty conversation before it), or a template's own
    refusal: a DataError naming the record, which skip_bad_records skips, not an unexpected error."""
    with pytest.raises(DataError, match="f.jsonl:3: the conversation opens with an assistant turn"):
        render([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "u"}], tok, "f.jsonl:3")

    class Strict:
        def apply_chat_template(self, *a, **k):
            raise ValueError("Conversation roles must alternate user/assistant")

    with pytest.raises(DataError, match="f.jsonl:4: the chat template cannot render.*must alternate"):
        render([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], Strict(), "f.jsonl:4")


def test_a_template_whose_prefixes_differ_from_the_whole_trains_each_turn_as_rendered_whole():
    """Qwen 3's template drops the reasoning of turns before the last user turn and gives the last assistant
    turn a (possibly empty) reasoning block, so a prefix renders differently inside the whole (this copy
    keeps its logic, on the tiny tokenizer's tokens). The conversation is then rendered once, whole: its
    ids are the template's, and each assistant turn trains from its header's end through its end of turn."""
    from pathlib import Path

    qwen3 = AutoTokenizer.from_pretrained(str(_assets() / "tiny"))
    qwen3.chat_template = (Path(__file__).parent / "data" / "qwen3_like.jinja").read_text()
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>r1</think>\n\nans one"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "<think>r2</think>ans two"}]
    for last, trained in [(conv[3], "ans one<|eos|>\n<think>\nr2\n</think>\n\nans two<|eos|>\n"),
                          ({"role": "assistant", "content": "ans two"},
                           "ans one<|eos|>\n<think>\n\n</think>\n\nans two<|eos|>\n")]:
        ids, labels = render(conv[:3] + [last], qwen3, "t")
        whole = qwen3.apply_chat_template(conv[:3] + [last], tokenize=True)
        assert ids == list(whole["input_ids"] if hasattr(whole, "keys") else whole)
        assert qwen3.decode([i for i, l in zip(ids, labels) if l != -100]) == trained
        assert "r1" not in qwen3.decode(ids)  # (the template's own choice: an earlier turn's reasoning dropped)
        # a cutoff inside the first turn: still the whole's rendering, cut (not the prefix's reasoning)
        cut, cut_labels = render(conv[:3] + [last], qwen3, "t", cutoff_len=12)
        assert cut[:30] == ids[:30] and cut_labels[:30] == labels[:30]
    # a template that loses a turn's content cannot be split into turns: the record is named
    qwen3.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{% if loop.last %}{{ m['content'] }}{% endif %}{% endfor %}"
    with pytest.raises(DataError, match="f.jsonl:2: the chat template renders a conversation prefix differently"):
        render(conv, qwen3, "f.jsonl:2")


def test_a_template_that_refuses_a_part_of_the_conversation_renders_it_whole():
    """Qwen 3.5's template refuses a conversation without a user turn, as the system prompt alone is: the
    conversation is rendered whole, each answer trained (every record with a system prompt was refused)."""
    t = AutoTokenizer.from_pretrained(str(_assets() / "tiny"))
    t.chat_template = (
        "{% set ns = namespace(q=false) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.q = true %}"
        "{% endif %}{% endfor %}{% if not ns.q %}{{ raise_exception('No user query found in messages.') }}{% endif %}"
        "{% for m in messages %}{{ '<' + m.role + '>' + m.content + eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")
    conv = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "answer"}]
    ids, labels = render(conv, t, "t")
    assert t.decode([i for i, l in zip(ids, labels) if l != -100]) == "answer<|eos|>"
    with pytest.raises(DataError, match="t: the chat template cannot render.*No user query"):  # (the whole too)
        render([conv[0], {"role": "assistant", "content": "a"}], t, "t")


def test_a_messages_records_system_prompt_and_message_keys_reach_the_template(tok):
    """A top-level system (LLaMA-Factory's, or mapped with columns) is the first message, as sharegpt's is;
    a message's other keys (Qwen 3's reasoning_content) go to the template, as transformers and TRL pass them
    (both were dropped without a word)."""
    t = AutoTokenizer.from_pretrained(str(_assets() / "tiny"))
    t.chat_template = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content is string %}"
                       "[{{ m.reasoning_content }}]{% endif %}{{ m.content }}{{ eos_token }}{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")
    rec = {"system": "be brief", "messages": [{"role": "user", "content": "q", "tool_calls": []},
                                              {"role": "assistant", "content": "a", "reasoning_content": "why",
                                               "tool_calls": [], "weight": True}]}
    msgs = to_messages(rec, "messages", "t")
    assert msgs[0] == {"role": "system", "content": "be brief"} and msgs[2]["reasoning_content"] == "why"
    assert all("tool_calls" not in m for m in msgs)  # (an export's empty list: no key, as templates test for it)
    ids, labels = render(msgs, t, "t")
    assert t.decode(ids).startswith("<system>be brief")
    assert t.decode([i for i, l in zip(ids, labels) if l != -100]) == "[why]a<|eos|>"
    own = {**rec, "messages": [{"role": "system", "content": "mine"}] + rec["messages"]}
    assert [m["content"] for m in to_messages(own, "messages", "t")] == ["mine", "q", "a"]


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
    ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\] needs"),
    ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}, "both strings or both lists"),
    ({"instruction": "x", "output": "y", "system": 5}, "needs 'system' as a string, if any"),
    ({"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]},
     "a 'completion' of assistant messages"),
    ({"messages": [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a"}]},
     r"messages\[0\]: 'weight' is for assistant messages"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0.5}]},
     r"messages\[1\]: 'weight' is for assistant messages, 0 \(not trained on\) or 1"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                     "tool_calls": [{"function": {"name": "f"}}]}]},
     r"messages\[1\] is a tool call or a tool's result, which slideformer does not train on yet"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}]},
     r"messages\[1\] is a tool call"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "{}"}]},
     r"turn 1 is a tool call or a tool's result \(function_call\)"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "system": 3},
     "needs 'system' as a string"),
    ({"instruction": "x", "output": "y", "history": [["only one"]]}, "needs 'history' as a list of"),
    ({"instruction": "x", "output": "y", "history": "earlier"}, "needs 'history' as a list of"),
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
    # formats mixed in one table: every record has every column, null where it had none; each is its own
    mixed = [{"instruction": "i", "output": "o"}, {"text": "t"}, {"messages": [{"role": "user", "content": "u"}]}]
    pytest.importorskip("pandas").DataFrame(mixed).to_parquet(tmp_path / "m.parquet")
    found = [detect_format(r, w) for w, r in read_records(tmp_path / "m.parquet")]
    assert found == ["alpaca", "text", "messages"]
    with pytest.raises(DataError, match="messages record needs"):  # (nulls alone: the format's own refusal)
        to_messages({"messages": None, "text": None}, detect_format({"messages": None, "text": None}, "r"), "r")


def test_datasets_sources_csv_save_to_disk_folders_and_hub_names(tmp_path, monkeypatch):
    """Through datasets: a CSV file, a save_to_disk folder with splits (split chooses; a wrong one is named), a
    folder of data files; a Hub name offline is one clear error with the fix."""
    import csv

    import datasets

    from slideformer.data.formats import read_records

    rows = [{"instruction": f"Say {i}", "input": "", "output": f"it is {i}"} for i in range(5)]
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    got = read_records(tmp_path / "d.csv")
    assert [r["output"] for _, r in got] == [f"it is {i}" for i in range(5)]
    assert got[0][0].endswith("d.csv[train record 0]") and to_messages(got[0][1], "alpaca", got[0][0])
    # an unquoted comma in the first row: pandas would read its first field as an index, each field one along
    (tmp_path / "c").mkdir()
    for where in (tmp_path / "c.csv", tmp_path / "c" / "b.csv"):
        where.write_text("instruction,output\nName three colors, please,red green blue\nWhat is 1+1?,2\n")
        (tmp_path / "c" / "a.csv").write_text("instruction,output\nfine,yes\n")  # (a folder's later file too)
        with pytest.raises(DataError, match=r"[bc]\.csv:2: 3 fields where the header names 2, so every row would be "
                                            "read one field along; a field holding ',' needs double quotes"):
            read_records(where.parent if where.parent.name == "c" else where)
    (tmp_path / "t.csv").write_text("instruction,output\nq1,a1,\nq2,a2,\n")  # (a trailing comma: shifted too)
    with pytest.raises(DataError, match=r"t\.csv:2: .*rows end with ',', a field more than the header names"):
        read_records(tmp_path / "t.csv")
    # R's write.table: row names, a field more on every row, which pandas reads as the index, as meant; and a
    # cell past the csv module's default limit of 131072 characters
    (tmp_path / "r.tsv").write_text('"instruction"\t"output"\n"1"\t"What is 2+2?"\t"4"\n"2"\t"Say hi"\t"hi"\n')
    assert [r["output"] for _, r in read_records(tmp_path / "r.tsv")] == ["4", "hi"]
    (tmp_path / "long.csv").write_text("text\n" + "word " * 40000 + "\n")
    assert len(read_records(tmp_path / "long.csv")[0][1]["text"]) == 200000
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                               "test": datasets.Dataset.from_list(rows[3:])})
    dd.save_to_disk(str(tmp_path / "saved"))
    assert [r["output"] for _, r in read_records(tmp_path / "saved", split="test")] == ["it is 3", "it is 4"]
    assert len(read_records(tmp_path / "saved")) == 3  # (train by default)
    with pytest.raises(DataError, match="has no split 'dev'; it has train, test"):
        read_records(tmp_path / "saved", split="dev")
    # what would be ignored is refused: a subset of a save, a split or subset of one file, an empty save
    from slideformer.data.lazy import open_records

    with pytest.raises(DataError, match="subset 'x' names a configuration .* remove subset:"):
        read_records(tmp_path / "saved", subset="x")
    (tmp_path / "d.jsonl").write_text('{"text": "a"}\n')
    for read in (read_records, open_records):
        with pytest.raises(DataError, match="d.jsonl is one dataset, read whole: it has no split 'test'"):
            read(tmp_path / "d.jsonl", split="test")
        with pytest.raises(DataError, match="it has no subset 'x'"):
            read(tmp_path / "d.jsonl", subset="x")
        datasets.Dataset.from_list(rows).select([]).save_to_disk(str(tmp_path / "empty"))
        with pytest.raises(DataError, match="empty holds no records"):
            read(tmp_path / "empty")
    (tmp_path / "shards").mkdir()
    datasets.Dataset.from_list(rows).to_json(str(tmp_path / "shards" / "part-0.jsonl"))
    assert len(read_records(tmp_path / "shards")) == 5
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="Hub dataset someorg/somedata.*hf download --repo-type dataset"):
        read_records("someorg/somedata")


def test_a_path_with_pattern_characters_is_that_file(tmp_path):
    """datasets reads a name as a glob pattern: "alp[1].csv" would read alp1.csv. The named file is read,
    whichever reader (up front or as reached); a folder of data files under such a path is refused."""
    import datasets

    from slideformer.data.lazy import open_records

    (tmp_path / "alp[1].csv").write_text("instruction,output\nright,yes\n")
    (tmp_path / "alp1.csv").write_text("text\nTHE WRONG FILE\n")
    datasets.Dataset.from_list([{"text": "right"}]).to_parquet(str(tmp_path / "p[1].parquet"))
    datasets.Dataset.from_list([{"text": "THE WRONG FILE"}]).to_parquet(str(tmp_path / "p1.parquet"))
    for read in (read_records, open_records):
        assert [dict(r) for _, r in read(tmp_path / "alp[1].csv")] == [{"instruction": "right", "output": "yes"}]
        assert [dict(r) for _, r in read(tmp_path / "p[1].parquet")] == [{"text": "right"}]
    (tmp_path / "d[1]").mkdir()
    (tmp_path / "d[1]" / "x.csv").write_text("text\nright\n")
    with pytest.raises(DataError, match=r"d\[1\]: its path holds \[, \], \* or \?.*rename the folder"):
        read_records(tmp_path / "d[1]")


def test_csv_cells_are_the_text_they_hold(tmp_path):
    """pandas would read "4" as a number and "NA" as missing: a CSV's (or TSV's) cells are read as text."""
    (tmp_path / "m.csv").write_text('instruction,input,output\n"What is 2+2?",NA,"4"\nx,,007\n')
    (tmp_path / "m.tsv").write_text('instruction\tinput\toutput\nWhat is 2+2?\tnull\t4\n')
    assert [r for _, r in read_records(tmp_path / "m.csv")] == [
        {"instruction": "What is 2+2?", "input": "NA", "output": "4"}, {"instruction": "x", "input": "", "output": "007"}]
    assert [r for _, r in read_records(tmp_path / "m.tsv")] == [
        {"instruction": "What is 2+2?", "input": "null", "output": "4"}]
    # pandas' own to_csv writes its index under an empty name; a repeated name is numbered, as pandas does
    (tmp_path / "index.csv").write_text(',instruction,output,output\n0,"What is 2+2?","4",5\n')
    assert [r for _, r in read_records(tmp_path / "index.csv")] == [
        {"Unnamed: 0": "0", "instruction": "What is 2+2?", "output": "4", "output.1": "5"}]


def test_a_folder_of_data_files_is_read_whole_and_csv_as_text(tmp_path):
    """A folder of CSV files reads its cells as text, as one CSV file does (its splits from the files' names);
    a data file datasets would leave out (another kind than the most common, or one not named for a split
    beside files that are) is refused, not dropped unsaid; hidden files, the dataset card and a .txt file beside
    data of another kind are not data; CSV and TSV files, separated differently, are not read as one."""
    from slideformer.data.lazy import open_records

    d, s = tmp_path / "qa", tmp_path / "splits"
    (d / "more").mkdir(parents=True)
    s.mkdir()
    (d / "a.csv").write_text('instruction,output\n"What is 2+2?",4\nSay NA,NA\n')
    (d / "more" / "part.csv").write_text("instruction,output\nx,007\n")
    (d / "README.md").write_text("# my data\n")
    (d / "LICENSE.txt").write_text("CC-BY 4.0\n")  # (beside CSV files: not a dataset's lines)
    (d / ".notes.jsonl").write_text('{"text": "not data"}\n')
    (s / "train.csv").write_text("instruction,output\np,1\n")
    (s / "test.csv").write_text("instruction,output\nq,1.5\n")
    for read in (read_records, open_records):
        assert sorted(tuple(dict(r).values()) for _, r in read(d)) == [
            ("Say NA", "NA"), ("What is 2+2?", "4"), ("x", "007")]
        assert [dict(r) for _, r in read(s, split="test")] == [{"instruction": "q", "output": "1.5"}]
    (d / "more" / "extra.jsonl").write_text('{"instruction": "dropped", "output": "unsaid"}\n')
    (s / "extra.csv").write_text("instruction,output\ndropped,unsaid\n")
    for read in (read_records, open_records):
        with pytest.raises(DataError, match=r"qa: datasets would leave out more/extra.jsonl \(it reads 2 .csv files "
                                            r"as split train\); keep one kind of data file a folder"):
            read(d)
        with pytest.raises(DataError, match=r"splits: datasets would leave out extra.csv \(it reads 2 .csv files as "
                                            r"split train, test\); .* each named for its split"):
            read(s, split="test")
    (d / "more" / "extra.jsonl").unlink()
    (d / "more" / "part.tsv").write_text("instruction\toutput\ny\t8\n")
    with pytest.raises(DataError, match="qa mixes .csv and .tsv files"):
        read_records(d)


def test_columns_map_a_records_own_keys_to_a_formats(tok, tmp_path):
    """A dataset's columns rename its records' keys (ours -> theirs) before the format is told; an optional key
    may be absent, a required one is named with its mapping; a key no format reads is refused in the config."""
    from slideformer.config import ConfigError
    from slideformer.data.formats import renamed
    from slideformer.train.config import load_config

    cols = {"instruction": "question", "input": "context", "output": "answer"}
    rec = renamed({"question": "Add", "answer": "five", "id": 3}, cols, "t")
    assert rec == {"instruction": "Add", "output": "five"} and trained_text(tok, rec) == "five<|eos|>"
    # (the format is told from the mapped keys alone: another format's keys in the record are not read; its
    # own optional input and system stay)
    also = renamed({"question": "Add", "answer": "five", "messages": [{"role": "user", "content": "x"}]}, cols, "t")
    assert detect_format(also, "t") == "alpaca"
    assert detect_format({"prompt": "a", "completion": "b", "text": "a b"}, "t") == "text"  # (a pre-rendered text wins)
    kept = renamed({"question": "Translate", "input": "Bonjour", "answer": "Hello"},
                   {"instruction": "question", "output": "answer"}, "t")
    assert kept == {"instruction": "Translate", "input": "Bonjour", "output": "Hello"}
    # (but not where columns maps it elsewhere)
    assert "system" not in renamed({"q": "a", "o": "b", "system": "own"}, {"instruction": "q", "output": "o",
                                                                            "system": "sp"}, "t")
    with pytest.raises(DataError, match=r"t: no key 'answer' \(the dataset's columns map output to it\)"):
        renamed({"question": "Add"}, cols, "t")
    assert trained_text(tok, renamed({"body": "all of it"}, {"text": "body"}, "t")) == "all of it<|eos|>"
    with pytest.raises(DataError, match=r"t: 'answer' \(the dataset's columns map output to it\) is int '5', not text"):
        renamed({"question": "2+3", "answer": 5}, cols, "t")  # (a CSV's numbers come as numbers)
    with pytest.raises(ConfigError, match="columns names 'answer', which no format reads"):
        load_config(None, [f"dataset=[{{path: {tmp_path}/d.jsonl, columns: {{answer: a}}}}]"])
    for bad in ("[a]", "{1: a, text: b}", "{}"):
        with pytest.raises(ConfigError, match="columns must map") as e:
            load_config(None, [f"dataset=[{{path: {tmp_path}/d.jsonl, columns: {bad}}}]"])
        assert ("quote them" in str(e.value)) == (bad == "{1: a, text: b}")
    with pytest.raises(ConfigError, match=r"got \{'output': False\} \(YAML reads yes, no.*quote them"):
        load_config(None, [f"dataset=[{{path: {tmp_path}/d.jsonl, columns: {{output: no}}}}]"])
    with pytest.raises(ConfigError, match="columns maps two keys to one"):
        load_config(None, [f"dataset=[{{path: {tmp_path}/d.jsonl, columns: {{instruction: q, output: q}}}}]"])


def test_a_chat_template_may_be_a_file(tmp_path):
    """chat_template: the template inline, or a .jinja file's path (as transformers saves chat_template.jinja);
    a path that is no file, or a file without Jinja, is one line naming it."""
    from slideformer.train.config import load_config
    from slideformer.train.loop import load_tokenizer

    template = (_assets() / "tiny" / "chat_template.jinja").read_text()
    (tmp_path / "t.jinja").write_text(template)
    assert load_tokenizer(load_config(None, [f"chat_template={tmp_path}/t.jinja"])).chat_template == template
    for value, needle in ((f"{tmp_path}/missing.jinja", "is neither a Jinja template"), (str(tmp_path), "is a folder")):
        with pytest.raises(DataError, match=needle):
            load_tokenizer(load_config(None, [f"chat_template={value}"]))
    (tmp_path / "plain.txt").write_text("no template here")
    with pytest.raises(DataError, match="plain.txt: holds no Jinja"):
        load_tokenizer(load_config(None, [f"chat_template={tmp_path}/plain.txt"]))
    # transformers' chat_template.json (or a tokenizer_config.json): the template under its key
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_tokenizer(load_config(None, [f"chat_template={tmp_path}/chat_template.json"])).chat_template == template
    (tmp_path / "other.json").write_text(json.dumps({"model_type": "llama", "note": "{% raw %}"}))
    with pytest.raises(DataError, match="other.json: a JSON file without a 'chat_template' string"):
        load_tokenizer(load_config(None, [f"chat_template={tmp_path}/other.json"]))
    (tmp_path / "huge.jinja").write_text("{{ x }}" + " " * (300 << 10))
    with pytest.raises(DataError, match="huge.jinja: over 256 KiB"):
        load_tokenizer(load_config(None, [f"chat_template={tmp_path}/huge.jinja"]))
    # (a template that renders no assistant content would leave no target: refused at the first chat record)
    from slideformer.config import ConfigError
    from slideformer.train.loop import describe_data

    (tmp_path / "users.jinja").write_text("{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}"
                                          "{% endfor %}")
    with pytest.raises(ConfigError, match="users.jinja renders no message's content"):
        describe_data(load_config(None, [f"chat_template={tmp_path}/users.jinja",
                                         f"dataset={_assets() / 'sample' / 'messages.jsonl'}"]), 0)
    # a config file's template path is relative to the config, as its dataset paths
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "c.yaml").write_text("model_name_or_path: tiny\nchat_template: ../t.jinja\n")
    assert load_tokenizer(load_config(tmp_path / "cfg" / "c.yaml")).chat_template == template


@pytest.mark.parametrize("rec, fmt, what", [
    ({"instruction": "a", "output": ""}, "alpaca", "assistant turn (message 1) is empty"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " \n"}]}, "sharegpt",
     "assistant turn (message 1) is empty"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                   {"role": "user", "content": "r"}, {"role": "assistant", "content": "s"}]}, "messages",
     "assistant turn (message 1) is empty"),
    ({"prompt": "p", "completion": ""}, "prompt_completion", "'completion' is empty"),
    ({"text": ""}, "text", "'text' is empty"),
])
def test_an_empty_answer_is_malformed_not_trained(rec, fmt, what):
    """An empty answer would train only the end of its turn (the model taught to stop at once), unsaid: a
    malformed record (skip_bad_records skips it). An empty turn of weight 0 is context, kept."""
    with pytest.raises(DataError, match=f"r: {fmt} record's {re.escape(what)}.*skip_bad_records"):
        to_messages(rec, fmt, "r")
    kept = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "weight": 0},
                         {"role": "user", "content": "r"}, {"role": "assistant", "content": "s"}]}
    assert len(to_messages(kept, "messages", "r")) == 4


def test_a_record_in_another_formats_shape_is_told_the_way_to_read_it():
    """OpenAI messages under sharegpt's key, or sharegpt turns read as messages: the refusal names what reads
    them (the dataset's columns, or the format)."""
    openai = {"conversations": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(DataError, match=r"turn 0 needs 'from'.*OpenAI messages.*columns: \{messages: conversations\}"):
        to_messages(openai, "sharegpt", "r")
    with pytest.raises(DataError, match=r"needs a non-empty list 'messages'; map .* "
                                        r"columns: \{messages: conversations\}"):
        to_messages(openai, "messages", "r")
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    with pytest.raises(DataError, match=r"holds sharegpt turns \('from', 'value'\): format: sharegpt \(or auto\)"):
        to_messages(sharegpt, "messages", "r")
    assert len(to_messages({"messages": openai["conversations"]}, "messages", "r")) == 2


def test_a_text_cut_for_speed_still_gives_the_tokens_cutoff_len_keeps():
    """render cuts long texts at a bound from the longest vocabulary entry; a tokenizer that drops characters
    (whitespace split off, as a WordLevel one's pre-tokenizer) gives fewer tokens from the cut: each text is
    then cut further out, so the first cutoff_len tokens are the whole record's, in a text (not an EOS or a
    word's fragment where the cut fell), a prompt and its completion, or a conversation's turns."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from slideformer.data.formats import max_token_chars

    words = ["<eos>", "<unk>", "hello", "world"]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    wl = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", unk_token="<unk>")
    wl.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    limit = 4 * (64 + 8) * max_token_chars(wl)  # (render's bound at cutoff_len 64)
    spaced = "hello" + " " * 3000 + " world" * 20
    assert len(render(spaced, wl, "t")[0]) == 22
    cases = [spaced, spaced + " world" * 60,
             "hello" + " " * (limit - 381) + " world" * 100,  # (the bound falls inside the 63rd token)
             (spaced, " hello" * 100),
             [{"role": "user", "content": spaced}, {"role": "assistant", "content": " hello" * 100}]]
    for rec in cases:
        whole, labels = render(rec, wl, "t")
        cut, cut_labels = render(rec, wl, "t", cutoff_len=64)
        assert cut[:64] == whole[:64] and cut_labels[:64] == labels[:64] and (len(cut) > 64) == (len(whole) > 64)


def test_a_conversation_cut_at_a_turn_boundary_reaches_past_cutoff_len(tok):
    """render stops at cutoff_len; a conversation whose turn ends exactly there renders the next turn too,
    so the caller sees it is cut (and counts it), not that it ends there."""
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "second answer"}]
    whole, labels = render(conv, tok, "t")
    turn = len(render(conv[:2], tok, "t")[0])
    assert turn < len(whole)
    ids, cut_labels = render(conv, tok, "t", cutoff_len=turn)
    assert len(ids) > turn and ids == whole[: len(ids)] and cut_labels == labels[: len(ids)]


def test_a_datasets_fingerprint_is_of_its_data_files(tmp_path):
    """What a resume compares: an edit that keeps the size or a shuffle changes it; a folder's hidden files
    (hf download's .cache, a .git) do not, as datasets reads none of them."""
    from slideformer.data.formats import fingerprint

    d = tmp_path / "d"
    (d / ".cache").mkdir(parents=True)
    lines = [json.dumps({"text": f"record {i}"}) + "\n" for i in range(20)]
    (d / "a.jsonl").write_text("".join(lines))
    (d / ".cache" / "a.jsonl.metadata").write_text("1")
    first = fingerprint(d)
    (d / ".cache" / "a.jsonl.metadata").write_text("2")
    assert fingerprint(d) == first and fingerprint(d / "a.jsonl") != first
    (d / "a.jsonl").write_text("".join(lines[1:] + lines[:1]))  # (the same size)
    assert fingerprint(d) != first
    assert fingerprint(tmp_path / "missing") is None and fingerprint("org/name") is None
