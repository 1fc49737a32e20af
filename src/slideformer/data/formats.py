"""Records from local files, in the formats users bring, rendered into token ids and labels.

Every format becomes a list of chat messages, rendered with the tokenizer's chat template; the loss is
on the assistant turns only (labels -100 elsewhere). Plain text is trained on whole. Supported:
- alpaca:   {"instruction", "input"?, "output", "system"?, "history"?: [[instruction, answer], ...]}
- sharegpt: {"conversations": [{"from": "human"|"gpt"|"system", "value"}], "system"?}
- messages: {"messages": [{"role": "user"|"assistant"|"system", "content", "weight"?: 0|1}]}  (OpenAI style;
            an assistant message of weight 0 is context, not trained on)
- prompt_completion: {"prompt", "completion"} (TRL's): strings, trained on the completion as plain text; or
            lists of messages, rendered with the chat template and trained on the completion's turns only
- text:     {"text"}
A dataset's ``columns`` maps these keys to a record's own (e.g. {instruction: question, output: answer}); the
format is then told from the mapped keys alone.
Files: JSONL, JSON (a list of records) and Parquet (through ``datasets``).
"""
from __future__ import annotations

import contextlib
import errno
import functools
import glob
import itertools
import json
import lzma
import os
import sys
import zlib
from pathlib import Path

FORMATS = ("alpaca", "sharegpt", "messages", "prompt_completion", "text")
KEYS = ("messages", "conversations", "instruction", "input", "output", "system", "history", "prompt", "completion",
        "text")
TEXT_KEYS = ("instruction", "input", "output", "system", "text")  # (read as strings only)
OPTIONAL_KEYS = ("input", "system", "history")  # (alpaca's: a record may go without them)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class DataError(ValueError):
    """A malformed record; the message names the file and line (or record index)."""


class _NotJson:
    """A JSONL line that is not JSON, read under ``skip_bad`` (to be counted as skipped). Not ``None``: a line
    ``null`` is JSON, a record that is no object, malformed like any other."""

    def __repr__(self) -> str:
        return "NOT_JSON"


NOT_JSON = _NotJson()


LOADERS = {".csv": "csv", ".tsv": "csv", ".arrow": "arrow"}  # file types read through datasets.load_dataset
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}  # the standard library's (zstd needs a package)
# what reading a compressed stream raises where it is not what its name says, cut short or damaged
STREAM_ERRORS = (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error)


def compressed_json(p: Path) -> bool:
    """A compressed JSON or JSONL file (``train.jsonl.gz``), read as the file it holds."""
    return p.suffix.lower() in COMPRESSIONS and Path(p.stem).suffix.lower() in (".json", *JSONL_SUFFIXES)


def _kind(p: Path) -> str:
    """The suffix that says how ``p`` reads: a compressed file's, that of the file it holds."""
    return Path(p.stem).suffix.lower() if compressed_json(p) else p.suffix.lower()


def _open_binary(p: Path):
    """``p`` for reading bytes, decompressed as its suffix says."""
    if compressed_json(p):
        import importlib

        return importlib.import_module(COMPRESSIONS[p.suffix.lower()]).open(p, "rb")
    return open(p, "rb")


# a name with one of these is a local file, never a Hub dataset's name (a missing one is said to be missing)
FILE_SUFFIXES = (".json", ".parquet", ".txt", ".gz", ".bz2", ".xz", ".zst", *JSONL_SUFFIXES, *LOADERS)


def read_records(path: str | os.PathLike, skip_bad: bool = False, split: str | None = None,
                 subset: str | None = None) -> list[tuple[str, object]]:
    """(where, record) pairs; ``where`` is "file:line" for JSONL, "file[record i]" otherwise. With
    ``skip_bad`` a JSONL line that is not valid JSON comes back as ``NOT_JSON`` (to be counted), not an error.
    JSONL, JSON and Parquet are read here; CSV and Arrow files, folders (``save_to_disk``'s, or of data
    files) and Hub dataset names through ``datasets`` (``split``, default train; ``subset``)."""
    p = Path(path)
    if read_by_datasets(path):
        return _through_datasets(str(path), p, split, subset)
    check_readable(p)
    check_one_dataset(p, split, subset)
    if p.suffix.lower() == ".parquet":
        return [(f"{p}[record {i}]", dict(r)) for i, r in enumerate(open_parquet(p))]
    try:
        return _read_json(p, skip_bad)
    except STREAM_ERRORS as e:
        if isinstance(e, DataError) or not compressed_json(p):
            raise
        raise DataError(f"{p}: cannot decompress it ({type(e).__name__}: {str(e)[:200]}); check the file, or "
                        "give it decompressed") from None


def _read_json(p: Path, skip_bad: bool) -> list[tuple[str, object]]:
    """A JSON file's list of records, or a JSONL file's lines, compressed or not."""
    if _kind(p) == ".json":
        try:
            with _open_binary(p) as f:
                data = json.loads(f.read().decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            raise DataError(f"{p}: not UTF-8 text (byte {e.start}); save it as UTF-8") from e
        except json.JSONDecodeError as e:
            if not (e.msg == "Extra data" and e.lineno > 1 and e.colno == 1 and _a_record(p)):
                raise DataError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from e
            data = None  # (a JSON record a line: JSON Lines under a .json name, as datasets reads it too)
        except RecursionError:
            raise DataError(f"{p}: JSON nested too deeply to be a dataset record") from None
        if data is not None:
            if not isinstance(data, list):
                raise DataError(f"{p}: a .json dataset must be a list of records (or a JSON record a line)")
            return [(f"{p}[record {i}]", r) for i, r in enumerate(data)]
    out = []
    with _open_binary(p) as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():  # (ASCII whitespace only, as data/lazy.py's index has it)
                out.append((f"{p}:{lineno}", jsonl_record(raw, p, lineno, skip_bad)))
    return out


@functools.lru_cache(maxsize=64)  # (a folder's files are found by a builder: once a run, not once a check)
def data_read(path: str | os.PathLike, split: str | None = None, subset: str | None = None) -> frozenset[tuple]:
    """What a dataset entry reads, to tell entries that read the same records: each data file's real path (a
    folder's: those of its split, as datasets picks them by name), a save_to_disk folder's with its split, a
    Hub name with its split and subset."""
    p = Path(path)
    if not p.exists():
        return frozenset({(str(path), split or "train", subset)})
    if p.is_dir() and not ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
        try:
            import datasets

            with _quiet_datasets():
                files = datasets.load_dataset_builder(str(p), subset).config.data_files or {}
            return frozenset((os.path.realpath(f),) for f in files.get(split or "train", []))
        except Exception:  # (the read itself says what is wrong with the folder)
            pass
    return frozenset({(os.path.realpath(p), split or "train") if p.is_dir() else (os.path.realpath(p),)})


def _a_record(p: Path) -> bool:
    """Whether the first line of ``p`` is a JSON object on its own (a JSONL file's first record)."""
    try:
        with _open_binary(p) as f:
            return isinstance(json.loads(f.readline().decode("utf-8-sig")), dict)
    except (*STREAM_ERRORS, RecursionError):
        return False


def jsonl_record(raw: bytes, p: Path, lineno: int, skip_bad: bool) -> object:
    """Line ``lineno`` of JSONL file ``p`` as its record; NOT_JSON for one that is not JSON under ``skip_bad``.
    A byte-order mark before the first line is not part of it (editors on Windows write one)."""
    where = f"{p}:{lineno}"
    if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte {e.start} of the line); save the file as UTF-8") from e
    try:
        return json.loads(line)
    except (json.JSONDecodeError, RecursionError) as e:
        if skip_bad:
            return NOT_JSON
        why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
        if lineno == 1 and _kind(p) not in JSONL_SUFFIXES:  # (likely another kind of file, not a bad line)
            raise DataError(f"{where}: not valid JSON ({why}); a {_kind(p) or 'suffix-less'} file is read as JSONL "
                            "(a JSON record a line): give JSONL, JSON, Parquet, CSV or Arrow, plain text as "
                            '{"text": ...} records') from None
        raise DataError(f"{where}: not valid JSON ({why}); fix the line, or set skip_bad_records: true to skip such "
                        "lines") from None


def read_by_datasets(path: str | os.PathLike) -> bool:
    """Whether ``datasets`` reads ``path``: a folder, an existing CSV or Arrow file, or a Hub name
    (``org/name``, no such local path). A missing local file is left to ``check_readable``, which says so."""
    p = Path(path)
    return p.is_dir() or (p.suffix.lower() in LOADERS and p.is_file()) or (not p.exists() and hub_name(str(path)))


def check_one_dataset(p: Path, split: str | None, subset: str | None) -> None:
    """A JSONL, JSON or Parquet file is one dataset: a split or subset asked of it would be ignored."""
    for key, value in (("split", split), ("subset", subset)):
        if value:
            raise DataError(f"dataset file {p} is one dataset, read whole: it has no {key} {value!r}; remove {key}: "
                            "(it names a part of a datasets folder or a Hub dataset)")


def check_readable(p: Path) -> None:
    """A file of records that exists, is readable and not compressed; a Parquet file with its markers."""
    if not p.is_file():
        raise DataError(f"dataset file {p} does not exist" if not p.exists() else f"dataset path {p} is not a file")
    try:
        with open(p, "rb") as f:
            head = f.read(6)
    except OSError as e:  # (it exists: permissions or the disk, exit 5 as any file that cannot be read)
        raise OSError(e.errno, f"dataset file {p}: cannot read it ({e.strerror})") from e
    if not compressed_json(p) and (head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:4] == b"\x28\xb5\x2f\xfd"
                                   or head == b"\xfd7zXZ\x00"):
        raise DataError(f"dataset file {p} is compressed (gzip, bzip2, xz or zstd); decompress it first (gunzip, "
                        "bunzip2, unxz, zstd -d) (JSON and JSONL files read compressed under their names: "
                        "train.jsonl.gz, .bz2 or .xz)")
    if p.suffix.lower() == ".parquet":
        with open(p, "rb") as f:
            f.seek(-min(4, p.stat().st_size), os.SEEK_END)
            tail = f.read(4)
        if head[:4] != b"PAR1" or tail != b"PAR1":
            raise DataError(f"dataset file {p}: not a readable Parquet file (no Parquet markers at its start and end)")


def open_parquet(p: Path):
    """A Parquet file as ``datasets``' Dataset (Arrow, memory-mapped)."""
    try:
        from datasets import Dataset
    except ImportError:
        raise DataError(f"{p}: reading Parquet needs the datasets package: pip install 'slideformer[data]' "
                        "(or pip install datasets)") from None
    try:
        import pyarrow.parquet as pq

        if pq.ParquetFile(p).metadata.num_rows == 0:
            raise DataError(f"dataset file {p} holds no records")
        with _quiet_datasets():
            return Dataset.from_parquet(glob.escape(str(p)))  # (the file itself: datasets reads a name as a pattern)
    except DataError:
        raise
    except Exception as e:  # pyarrow raises its own types for a file that is not Parquet
        raise DataError(f"dataset file {p}: not a readable Parquet file ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''})") from e


def detect_format(rec: dict, where: str) -> str:
    if not isinstance(rec, dict):
        kind = {type(None): "null", list: "a list", str: "a string", bool: "a boolean"}.get(type(rec), "a number")
        raise DataError(f"{where}: expected a record (a JSON object), got {kind}")
    # keys with a value first: a table (Parquet, Arrow, a folder through datasets) gives every record every
    # column, null where the record has none; then keys at all, so that a record of nulls is refused by its
    # format's own message
    for has in (lambda k: rec.get(k) is not None, lambda k: k in rec):
        if has("messages"):
            return "messages"
        if has("conversations"):
            return "sharegpt"
        if has("instruction") and has("output"):
            return "alpaca"
        if has("text"):
            return "text"
        if has("prompt") and has("completion"):
            return "prompt_completion"
    raise DataError(f"{where}: cannot tell the format from keys {_keys(rec)}; expected one of "
                    "messages / conversations / instruction+output / prompt+completion / text, or map the record's "
                    "keys to those with the dataset's columns (e.g. {instruction: question, output: answer})")


def _keys(rec: dict, most: int = 12) -> str:
    """A record's keys for a message: a few, each cut short (a record may hold thousands, or one of 200 KB)."""
    keys = [k if len(k) <= 40 else k[:37] + "..." for k in sorted(rec)[:most]]
    return str(keys) + (f" and {len(rec) - most} more" if len(rec) > most else "")


def renamed(rec, columns: dict | None, where: str):
    """The record with its keys under the names the formats read (a dataset's ``columns``: ours -> theirs)."""
    if not columns or not isinstance(rec, dict):
        return rec
    missing = [theirs for ours, theirs in columns.items() if theirs not in rec and ours not in OPTIONAL_KEYS]
    if missing:
        ours = next(o for o, t in columns.items() if t == missing[0])
        raise DataError(f"{where}: no key {missing[0]!r} (the dataset's columns map {ours} to it); the record has "
                        f"{_keys(rec)}")
    for ours, theirs in columns.items():
        v = rec.get(theirs)
        if ours in TEXT_KEYS and v is not None and not isinstance(v, str):
            raise DataError(f"{where}: {theirs!r} (the dataset's columns map {ours} to it) is "
                            f"{type(v).__name__} {str(v)[:40]!r}, not text")
    out = {k: rec[k] for k in OPTIONAL_KEYS  # (the record's own optional keys, where not mapped: kept)
           if k in rec and k not in columns and k not in columns.values()}
    out.update((ours, rec[theirs]) for ours, theirs in columns.items() if theirs in rec)
    return out


def _text(v: str, where: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"{where}: text holds invalid Unicode (an unpaired surrogate escape such as \\ud800)") from None
    return v


def to_messages(rec: dict, fmt: str, where: str) -> list[dict] | str | tuple[str, str]:
    """Chat messages for chat formats (a message with ``"prompt": True`` is not trained on, whatever its
    role); the raw string for "text"; (prompt, completion) for plain prompt-completion records. Every text
    is checked to be valid Unicode."""
    out = _to_messages(rec, fmt, where)
    fix = "fill it, or drop the record (skip_bad_records: true skips such records)"
    if isinstance(out, str):
        if not out.strip():  # (its one trained token would be the end of text)
            raise DataError(f"{where}: text record's 'text' is empty: nothing to train on; {fix}")
        return _text(out, where)
    if isinstance(out, tuple):
        if not out[1].strip():
            raise DataError(f"{where}: prompt_completion record's 'completion' is empty: it would train the model "
                            f"to end at once; {fix}")
        return tuple(_text(t, where) for t in out)
    for i, m in enumerate(out):
        if m["role"] == "assistant" and not m.get("prompt") and not m["content"].strip():
            raise DataError(f"{where}: {fmt} record's assistant turn (message {i}) is empty: it would train the "
                            f"model to end its turn at once; {fix}")
        for v in m.values():
            if isinstance(v, str):
                _text(v, where)
    return out


def _to_messages(rec: dict, fmt: str, where: str) -> list[dict] | str:
    def need(cond, what):
        if not cond:
            raise DataError(f"{where}: {fmt} record {what}")

    need(isinstance(rec, dict), "must be a JSON object")
    if fmt == "text":
        need(isinstance(rec.get("text"), str), "needs a string 'text'")
        return rec["text"]
    if fmt == "alpaca":
        for k in ("instruction", "output"):
            need(isinstance(rec.get(k), str), f"needs a string {k!r}")
        for k in ("input", "system"):
            need(rec.get(k) is None or isinstance(rec[k], str), f"needs {k!r} as a string, if any")
        user = rec["instruction"] + (f"\n{rec['input']}" if rec.get("input") else "")
        msgs = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
        history = rec.get("history") or []  # (LLaMA-Factory's earlier turns: [instruction, answer] pairs)
        need(isinstance(history, list) and all(isinstance(t, list) and len(t) == 2 and all(isinstance(x, str) for x in t)
                                              for t in history), "needs 'history' as a list of [instruction, answer] "
             "pairs of strings, if any")
        for question, answer in history:
            msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]
    if fmt == "sharegpt":
        conv = rec.get("conversations")
        need(isinstance(conv, list) and conv, "needs a non-empty list 'conversations'")
        msgs = []
        for i, turn in enumerate(conv):
            need(not (isinstance(turn, dict) and turn.get("from") in ("function_call", "observation", "tool")),
                 f"turn {i} is a tool call or a tool's result ({turn.get('from') if isinstance(turn, dict) else ''}), "
                 "which slideformer does not train on yet; drop such records (skip_bad_records: true skips them)")
            openai = isinstance(turn, dict) and "role" in turn and "content" in turn and "from" not in turn
            need(isinstance(turn, dict) and turn.get("from") in SHAREGPT_ROLES and isinstance(turn.get("value"), str),
                 f"turn {i} needs 'from' in {sorted(SHAREGPT_ROLES)} and a string 'value'" + (
                     "; its turns are OpenAI messages ('role', 'content'): read them as such with the dataset's "
                     "columns: {messages: conversations}" if openai else ""))
            msgs.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
        return _with_system(msgs, rec.get("system"), need)
    if fmt == "messages":
        if "messages" not in rec and len(lists := [k for k, v in rec.items() if isinstance(v, list)]) == 1:
            turns = rec[lists[0]]
            sharegpt = bool(turns) and all(isinstance(t, dict) and "from" in t for t in turns)
            need(False, "needs a non-empty list 'messages'; " + (
                f"its {lists[0]!r} holds sharegpt turns ('from', 'value'): format: sharegpt (or auto) reads them"
                if sharegpt else f"map the record's list to it with the dataset's columns: {{messages: {lists[0]}}}"))
        msgs = _messages(rec.get("messages"), need, "messages")
        return _with_system(msgs, rec.get("system"), need)
    if fmt == "prompt_completion":
        prompt, completion = rec.get("prompt"), rec.get("completion")
        need(prompt is not None and completion is not None, "needs both 'prompt' and 'completion'")
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
        need(isinstance(prompt, list) and isinstance(completion, list),
             "needs 'prompt' and 'completion' both strings or both lists of messages")
        completion = _messages(completion, need, "completion")
        need(all(m["role"] == "assistant" for m in completion), "needs a 'completion' of assistant messages")
        return [{**m, "prompt": True} for m in _messages(prompt, need, "prompt")] + completion
    raise DataError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)} or auto")


def _with_system(msgs: list[dict], system, need) -> list[dict]:
    """A record's top-level system prompt (LLaMA-Factory's sharegpt and messages records carry one) as its
    first message, unless a system message of its own stands."""
    need(system is None or isinstance(system, str), "needs 'system' as a string")
    if system and not any(m["role"] == "system" for m in msgs):
        msgs.insert(0, {"role": "system", "content": system})
    return msgs


def _messages(msgs, need, key: str) -> list[dict]:
    """A record's list of OpenAI-style messages, checked. A message's other keys (Qwen 3's
    ``reasoning_content``) go to the chat template as they are, as transformers and TRL pass them; an
    assistant message's ``weight`` 0 (OpenAI's fine-tuning format) makes it context, not trained on."""
    need(isinstance(msgs, list) and msgs, f"needs a non-empty list {key!r}")
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        need(role not in ("tool", "function", "ipython") and not (isinstance(m, dict) and m.get("tool_calls")),
             f"{key}[{i}] is a tool call or a tool's result, which slideformer does not train on yet; drop such "
             "records (skip_bad_records: true skips them)")
        need(role in ("system", "user", "assistant") and isinstance(m.get("content"), str),
             f"{key}[{i}] needs 'role' in system/user/assistant and a string 'content'")
        w = m.get("weight")  # (None: absent; Arrow gives every message of a struct column each key)
        need(w is None or (w in (0, 1) and role == "assistant"),
             f"{key}[{i}]: 'weight' is for assistant messages, 0 (not trained on) or 1")
    # (Arrow gives every message of a struct column each key: a None is a key the message has not; nor is an
    # empty list, as exports write "tool_calls": [], which some templates test by the key's presence alone)
    return [{**{k: v for k, v in m.items() if k not in ("weight", "prompt") and v not in (None, [], {})},
             **({"prompt": True} if m.get("weight") == 0 else {})} for m in msgs]


def chat_template_text(value: str) -> str:
    """The chat_template key's template: given inline (Jinja), or the path of a file that holds one."""
    if "{{" in value or "{%" in value:
        return value
    p = Path(value).expanduser()
    if not p.is_file():
        what = "a folder" if p.is_dir() else "neither a Jinja template (no {{ or {%) nor a file"
        raise DataError(f"chat_template {value!r} is {what}; give the template itself or the path of a .jinja file")
    try:
        with open(p, encoding="utf-8") as f:
            if p.suffix.lower() != ".json":
                text = f.read(MAX_TEMPLATE_CHARS + 1)  # (past that, refused below)
            else:  # chat_template.json, or a tokenizer_config.json: the template under its key
                text = json.load(f).get("chat_template")
                if not isinstance(text, str):
                    raise ValueError
    except OSError as e:
        raise OSError(e.errno, f"chat_template {p}: cannot read it ({e.strerror})") from e
    except UnicodeDecodeError:
        raise DataError(f"chat_template {p}: not UTF-8 text; give a Jinja template file") from None
    except (ValueError, AttributeError):  # (JSON that does not parse, or holds no one template)
        raise DataError(f"chat_template {p}: a JSON file without a 'chat_template' string; give a .jinja file, "
                        "or the JSON file transformers saves (chat_template.json)") from None
    if "{{" not in text and "{%" not in text:
        raise DataError(f"chat_template {p}: holds no Jinja ({{{{ or {{%); give a chat template file")
    if len(text) > MAX_TEMPLATE_CHARS:
        raise DataError(f"chat_template {p}: over {MAX_TEMPLATE_CHARS // 1024} KiB, more than any chat template; "
                        "give the template's own file")
    return text


MAX_TEMPLATE_CHARS = 256 * 1024  # far above any real chat template; above it, likely a file's contents by mistake


def check_chat_template(template: str, where: str = "chat_template") -> None:
    """Refuse, before any record is read, a template whose rendering alone would dominate the work (each
    record renders it several times), or one that is not Jinja at all: compiled as transformers compiles
    it, so a syntax error names the template, never each record."""
    if len(template) > MAX_TEMPLATE_CHARS:
        raise DataError(f"{where} is {len(template) / 2**20:.1f} MiB of text; chat templates are Jinja of at most "
                        f"{MAX_TEMPLATE_CHARS // 1024} KiB: give the template itself, not a file's contents")
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise DataError(f"{where}: not a valid Jinja template (line {e.lineno}: {e.message}); fix the template, "
                        "or leave chat_template unset for the model's own") from None


PROBE = ("slideformer probe question", "slideformer probe answer", "slideformer probe reasoning")


def template_probe(tokenizer, where: str) -> tuple[str | None, str | None]:
    """A plain exchange rendered by the tokenizer's chat template (``where`` names it), before any record:
    (refusal, note). A template that renders no message's content (one that reads another key than
    'content') gets a refusal for the first chat record, as every one would train on the template's own
    text; one that puts an assistant header before the content but gives nothing for add_generation_prompt
    gets a note: the header is then trained as part of each answer; so does one that drops an answer's
    reasoning (``<think>...</think>``) even from the last turn, as DeepSeek-R1's does: reasoning data would
    train without it. Data that is not chat never renders it."""
    conv = [{"role": "user", "content": PROBE[0]}, {"role": "assistant", "content": PROBE[1]}]
    try:
        whole = tokenizer.apply_chat_template(conv, tokenize=False)
        bare = tokenizer.apply_chat_template(conv[:1], tokenize=False)
        header = tokenizer.apply_chat_template(conv[:1], tokenize=False, add_generation_prompt=True)
    except Exception:  # (a template that refuses this exchange says why per record)
        return None, None
    if not all(isinstance(t, str) for t in (whole, bare, header)):
        return None, None
    if not all(text in whole for text in PROBE[:2]):
        return (f"{where} renders no message's content (a message is {{'role': ..., 'content': ...}}): chat "
                "records would train on the template's own text; make it read message['content']"), None
    if header == bare and whole.startswith(bare) and whole.find(PROBE[1]) > len(bare):
        lead = whole[len(bare): whole.index(PROBE[1])]
        if lead.strip():
            return None, (f"{where} puts {lead[:60]!r} before an assistant turn's content, and nothing for "
                          "add_generation_prompt: chat records train those tokens as part of each answer; give "
                          "the template an add_generation_prompt branch to leave them out")
    try:
        thought = tokenizer.apply_chat_template(
            [conv[0], {"role": "assistant", "content": f"<think>\n{PROBE[2]}\n</think>\n\n{PROBE[1]}"}],
            tokenize=False)
    except Exception:
        thought = None
    if isinstance(thought, str) and PROBE[1] in thought and PROBE[2] not in thought:
        return None, (f"{where} drops an answer's reasoning (<think>...</think>), even in the last turn: records "
                      "with reasoning train without it; give a chat_template that keeps it to train it")
    return None, None


def max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry in characters: ``cutoff_len`` tokens never span more than that many
    characters each, so text past a bound derived from it cannot reach the model."""
    return max(8, max((len(t) for t in tokenizer.get_vocab()), default=8))


def _clip(text: str, limit: int | None, tokenizer=None, cutoff_len: int | None = None) -> str:
    """``text`` cut at ``limit`` characters, or at four times as many until the cut alone gives more than
    ``cutoff_len`` tokens (a tokenizer that drops characters, whitespace split off or a normalizer's, gives
    fewer than the bound counts on): what is cut then lies past the tokens a sample keeps."""
    while limit is not None and len(text) > limit:
        if len(tokenizer(text[:limit], add_special_tokens=False)["input_ids"]) > cutoff_len + 8:
            return text[:limit]
        limit *= 4
    return text


def render(rec_messages, tokenizer, where: str, cutoff_len: int | None = None,
           token_chars: int | None = None) -> tuple[list[int], list[int]]:
    """Token ids and labels: assistant turns (and their end markers) are trained on, the rest is -100.

    With ``cutoff_len`` the work is bounded whatever a record's size: each text is cut to four times the
    characters ``cutoff_len`` tokens can span (``token_chars``, the longest vocabulary entry; a cut that
    far out cannot change the first ``cutoff_len`` tokens; ``_clip`` checks it), and no message is rendered
    once the tokens pass ``cutoff_len``. The caller still truncates to ``cutoff_len``."""
    limit = None
    if cutoff_len is not None:
        limit = 4 * (cutoff_len + 8) * (token_chars or max_token_chars(tokenizer))
    clip = functools.partial(_clip, limit=limit, tokenizer=tokenizer, cutoff_len=cutoff_len)
    if isinstance(rec_messages, str):
        # the tokenizer's own special tokens (Llama 3's and Gemma's BOS), as transformers' run_clm and TRL
        # tokenize text; then the end of the document, where they add none
        ids = list(tokenizer(clip(rec_messages))["input_ids"])
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
        return ids, list(ids)
    if isinstance(rec_messages, tuple):
        # as TRL: prompt and prompt + completion tokenized alike, the tokens past the prompt's trained, then EOS
        # (the prompt's own tokens end where they first differ: a prompt's last token may merge with the
        # completion's first, as "Answer: " + "blue")
        prompt, completion = (clip(t) for t in rec_messages)
        alone = tokenizer(prompt)["input_ids"]
        ids = list(tokenizer(prompt + completion)["input_ids"])
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids.append(tokenizer.eos_token_id)
        start = next((i for i, (a, b) in enumerate(zip(alone, ids)) if a != b), min(len(alone), len(ids)))
        start = min(start, len(ids) - 1)
        return ids, [-100] * start + ids[start:]
    trained = [m["role"] == "assistant" and not m.get("prompt") for m in rec_messages]
    msgs = [{k: clip(v) if isinstance(v, str) else v for k, v in m.items() if k != "prompt"}
            for m in rec_messages]
    if not any(trained):
        raise DataError(f"{where}: the conversation has no assistant turn to train on (each is in the prompt, or of "
                        "weight 0)" if any(m["role"] == "assistant" for m in rec_messages) else
                        f"{where}: the conversation has no assistant turn to train on")
    def tok(prefix, gen):
        if not prefix:  # (an assistant turn first: no template renders an empty conversation)
            raise DataError(f"{where}: the conversation opens with an assistant turn; the chat template needs a "
                            "user (or system) turn before it")
        try:
            out = tokenizer.apply_chat_template(prefix, tokenize=True, add_generation_prompt=gen)
        except Exception as e:  # (the template's own refusal: jinja's raise_exception, a role order it rejects)
            if gen or len(prefix) < len(msgs):  # (a part it refuses, Qwen 3.5's system prompt alone: the whole)
                raise _PrefixUnstable from None
            raise DataError(f"{where}: the chat template cannot render this conversation "
                            f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})") from None
        out = list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5
        if out[: len(ids)] != ids:
            raise _PrefixUnstable
        return out

    ids: list[int] = []
    labels: list[int] = []
    # Render growing prefixes and attribute the new tokens to the newest message: this follows whatever
    # the tokenizer's template does around turns, without parsing it. An assistant turn's header (what
    # add_generation_prompt adds) is prompt, not target.
    try:
        for k in range(1, len(msgs) + 1):
            if cutoff_len is not None and len(ids) > cutoff_len:  # (at it: the sample is cut only if more follows)
                tok(msgs, False)  # (nothing later reaches the model, but the whole must render these first)
                break
            if trained[k - 1]:
                header = tok(msgs[: k - 1], True)
                full = tok(msgs[:k], False)
                # (where they first differ: a turn whose content starts with whitespace merges it with the
                # header's last token, which is then the content's first, trained)
                start = next((i for i, (a, b) in enumerate(zip(header, full)) if a != b), min(len(header), len(full)))
                labels += [-100] * (start - len(ids)) + full[start:]
            else:
                full = tok(msgs[:k], False)
                labels += [-100] * (len(full) - len(ids))
            ids = full
    except _PrefixUnstable:
        return _render_whole(msgs, trained, tokenizer, where)
    return ids, labels


class _PrefixUnstable(Exception):
    """A conversation's prefix renders differently inside the whole (Qwen 3's template drops the reasoning of
    turns before the last user turn, and gives the last assistant turn an empty one)."""


def _render_whole(msgs: list[dict], trained: list[bool], tokenizer, where: str) -> tuple[list[int], list[int]]:
    """Token ids and labels of a conversation rendered once, whole, for templates whose prefixes are not
    prefixes of the whole. Each ``trained`` assistant turn is found by rendering the conversation with a
    marker for its content: the text between the markers is the template's own, and the real rendering is
    that text around each turn's content. A turn trains from where its header (what add_generation_prompt adds)
    ends, as rendered whole, through its content and the end-of-turn text the template puts after it."""
    def text(conv: list[dict], gen: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
        except Exception as e:
            raise DataError(f"{where}: the chat template cannot render this conversation "
                            f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})") from None

    def unsupported(why: str) -> DataError:
        return DataError(f"{where}: the chat template renders a conversation prefix differently from the whole, "
                         f"and {why}; give a template that renders each turn the same in any prefix (chat_template)")

    def shared(a: str, b: str) -> str:
        """The whole tokens ``a`` begins with that ``b`` begins with too (never part of one: Phi-3's EOS and
        next user header both begin "<|")."""
        try:
            ta, tb = (tokenizer(t, add_special_tokens=False, return_offsets_mapping=True) for t in (a, b))
        except (NotImplementedError, TypeError, ValueError):  # (a slow tokenizer has no offsets)
            raise unsupported("its tokenizer gives no character offsets (a fast tokenizer does)") from None
        n = next((k for k, (x, y) in enumerate(zip(ta["input_ids"], tb["input_ids"])) if x != y),
                 min(len(ta["input_ids"]), len(tb["input_ids"])))
        return a[: ta["offset_mapping"][n - 1][1]] if n else ""

    turns = [i for i, t in enumerate(trained) if t]
    marks = {i: f"<<slideformer-turn-{i}>>" for i in turns}
    # (a reasoning block before the answer, "<think>...</think>", stays: templates that take it apart do so
    # alike with the marker after it)
    marked = [{**m, "content": m["content"][: m["content"].rfind("</think>") + 8] * ("</think>" in m["content"])
               + marks[i]} if i in marks else m for i, m in enumerate(msgs)]
    whole_marked, whole = text(marked), text(msgs)
    if any(whole_marked.count(marks[i]) != 1 for i in turns):
        raise unsupported("it does not render each assistant turn's content once")
    pieces = [whole_marked]  # the template's text between the markers, in order
    for i in turns:
        pieces[-1:] = pieces[-1].split(marks[i])
    spans, at = [], len(pieces[0])
    if not whole.startswith(pieces[0]) or not whole.endswith(pieces[-1]):
        raise unsupported("its text around the turns changes with their content")
    for n, i in enumerate(turns):
        after = pieces[n + 1]
        end = len(whole) - len(after) if n + 1 == len(turns) else whole.find(after, at)
        if end < at:
            raise unsupported("its text around the turns changes with their content")
        alone = text(marked[: i + 1])  # the turn last: what closes it
        close = alone[alone.rindex(marks[i]) + len(marks[i]):]
        if n + 1 < len(turns) or not after.startswith(close):
            # (what closes it as the whole has it: the part the two share; Phi-3's template ends a conversation
            # with its EOS after the turn's own end)
            close = shared(close, after)
            if not close.strip() and alone[alone.rindex(marks[i]) + len(marks[i]):].strip():
                raise unsupported("it closes a turn differently when it is the last")
        base = text(marked[:i]) if i else ""
        prompt = text(marked[:i], True)
        header = prompt[len(base):] if i else prompt
        before = whole[:at]
        start = before.rfind(header) + len(header) if header and before.rfind(header) >= at - len(pieces[n]) else at
        if not header and i and alone.startswith(base):
            # (no generation prompt: the turn's own text before its content, " " in "[/INST] answer", is trained
            # as the prefixes train it)
            lead = alone[len(base): alone.rindex(marks[i])]
            start = at - len(lead) if lead and before.endswith(lead) and len(lead) <= len(pieces[n]) else at
        spans.append((start, end + len(close)))
        at = end + len(after) if n + 1 < len(turns) else len(whole)
    try:
        enc = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):  # (a slow tokenizer has no offsets)
        raise unsupported("its tokenizer gives no character offsets (a fast tokenizer does)") from None
    ids = list(enc["input_ids"])
    # (a token that spans a turn's start, " Paris" after a template's space, is trained, as the prefixes' first
    # differing token is)
    labels = [t if any(a < e and (b > s or s <= a) for s, e in spans) else -100
              for t, (a, b) in zip(ids, enc["offset_mapping"])]
    return ids, labels


def hub_name(name: str) -> bool:
    """Whether ``name`` reads as a Hub dataset ("org/name", no such local path, not a file's name)."""
    parts = name.split("/")
    return (len(parts) == 2 and all(parts) and not name.startswith((".", "~")) and "." not in parts[0]
            and Path(name).suffix.lower() not in FILE_SUFFIXES)


def _through_datasets(name: str, p: Path, split: str | None, subset: str | None) -> list[tuple[str, dict]]:
    """Records that ``datasets`` reads: a save_to_disk folder, a folder of data files, a CSV or Arrow file, a
    Hub dataset (online only)."""
    data, tag = open_through_datasets(name, p, split, subset)
    return [(f"{name}[{tag} {i}]", dict(r)) for i, r in enumerate(data)]


def _csv_as_text(p: Path, datasets) -> dict:
    """load_dataset's options that read every cell of a CSV or TSV file as the text it holds: an answer "4"
    stays a string, "NA" or "null" are words, an empty cell is empty (pandas would guess numbers and
    missing values)."""
    import pandas

    sep = "\t" if p.suffix.lower() == ".tsv" else ","
    # (the column names as pandas makes them, which datasets' reader uses: "Unnamed: 0" for an empty one,
    # "output.1" for a repeated one; a header pandas cannot parse raises its ValueError, said as the file's)
    names = pandas.read_csv(p, sep=sep, nrows=0, encoding_errors="replace").columns
    _check_fields(p, sep, len(names))
    return {"delimiter": sep, "keep_default_na": False,
            "features": datasets.Features({str(name): datasets.Value("string") for name in names})}


def _check_fields(p: Path, sep: str, columns: int, look: int = 1000) -> None:
    """A first data row with more fields than the header is refused, naming its line: pandas then reads each
    row's first field(s) as its index, which shifts the fields of every row along, silently (an unquoted
    comma, a trailing delimiter). Not where each of the first ``look`` rows has one field more and some
    last field filled: R's write.table row names, which pandas reads as meant. (A later row with more
    fields than the first is pandas' own error.)"""
    import csv

    csv.field_size_limit(sys.maxsize)  # (an answer of a million characters is one cell)
    with open(p, newline="", encoding="utf-8", errors="replace") as f:
        rows = csv.reader(f, delimiter=sep)
        try:
            next(rows, None)
            first = next((r for r in rows if r), None)
            if first is None or len(first) <= columns:
                return
            line, shape, filled = rows.line_num, [len(first)], bool(first[-1])
            for row in itertools.islice((r for r in rows if r), look - 1):
                shape.append(len(row))
                filled |= bool(row[-1])
        except csv.Error as e:
            raise DataError(f"{p}:{rows.line_num}: not readable as CSV ({e})") from None
    if set(shape) == {columns + 1} and filled:
        return
    why = f"rows end with {sep!r}, a field more than the header names: remove it, or name the column" if \
        set(shape) == {columns + 1} else f"a field holding {sep!r} needs double quotes (\"like{sep} this\")"
    raise DataError(f"{p}:{line}: {len(first)} fields where the header names {columns}, so every row would be "
                    f"read one field along; {why}")


def open_through_datasets(name: str, p: Path, split: str | None, subset: str | None):
    """``datasets``' Dataset of what ``_through_datasets`` reads (Arrow, memory-mapped), and how a record of
    it is named ("record", or the split's)."""
    if subset and p.exists() and (p.is_file() or (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
        raise DataError(f"dataset {name}: subset {subset!r} names a configuration of a Hub dataset or a folder of "
                        "data files; this one has none: remove subset:")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{name}: reading it needs the datasets package: pip install 'slideformer[data]'") from None
    try:
        with _quiet_datasets():
            data = _load(datasets, name, p, subset)
    except DataError:
        raise
    except (FileNotFoundError, ConnectionError, OSError, ValueError, RuntimeError,  # (RuntimeError: a loading script)
            datasets.exceptions.DatasetGenerationError) as e:
        if isinstance(e, datasets.exceptions.DatasetGenerationError) and e.__cause__ is not None:
            e = e.__cause__  # (the parser's own error says what is wrong)
        if isinstance(e, OSError) and (e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
                                       or "disk space" in str(e)):  # (its cache: datasets writes only there)
            cache, env = f"its cache {datasets.config.HF_DATASETS_CACHE}", "HF_DATASETS_CACHE"
            if not p.exists():  # (a Hub name's files are downloaded first, into the Hub's cache)
                from huggingface_hub import constants

                cache, env = f"{cache} or the Hub's download cache {constants.HF_HUB_CACHE}", f"{env} and HF_HUB_CACHE"
            raise OSError(e.errno or errno.ENOSPC, f"dataset {name}: datasets cannot write {cache} "
                          f"({e.strerror or str(e).split('.')[0]}); free space there, or set {env} to a writable "
                          "folder with room") from e  # (exit 5)
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) and e.errno and p.exists():
            raise OSError(e.errno, f"dataset {name}: datasets cannot read it ({e.strerror})") from e  # (exit 5)
        where = "folder" if p.is_dir() else "file" if p.is_file() else "Hub dataset"
        hint = "" if p.exists() or not isinstance(e, (ConnectionError, FileNotFoundError)) else (
            "; offline, fetch it first: hf download --repo-type dataset " + name + " --local-dir DIR, and give DIR")
        raise DataError(f"{'' if where == 'Hub dataset' else 'dataset '}{where} {name}: datasets cannot read it "
                        f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}){hint}") from e
    if isinstance(data, datasets.DatasetDict):
        want = split or "train"
        if want not in data:
            raise DataError(f"dataset {name} has no split {want!r}; it has {', '.join(data)} (set split:)")
        data = data[want]
        tag = f"{want} record"
    else:
        if split:
            raise DataError(f"dataset {name} has no splits (it is one dataset); remove split: {split}")
        tag = "record"
    return data, tag


@contextlib.contextmanager
def _quiet_datasets():
    """``datasets``' progress bars and log lines off meanwhile: an error is said once, in our line."""
    import datasets

    from huggingface_hub.utils import logging as hub_logging  # (a folder's README.md: "no metadata block")

    bars, level, hub = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity(), hub_logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    hub_logging.set_verbosity(hub_logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        hub_logging.set_verbosity(hub)
        if bars:
            datasets.enable_progress_bars()


def _load(datasets, name: str, p: Path, subset: str | None):
    """What ``open_through_datasets`` reads, as datasets gives it (a Dataset or a DatasetDict)."""
    if p.is_dir() and ((p / "dataset_dict.json").is_file() or (p / "state.json").is_file()):
        try:
            return datasets.load_from_disk(str(p))
        except IndexError:  # (datasets cannot load a save of no rows: it concatenates none)
            raise DataError(f"dataset folder {name} holds no records (a save of an empty dataset, or of an "
                            "empty split)") from None
    if p.is_file():
        return datasets.load_dataset(LOADERS[p.suffix.lower()], data_files=glob.escape(str(p)),
                                     **(_csv_as_text(p, datasets) if LOADERS[p.suffix.lower()] == "csv" else {}))
    if p.is_dir():
        return _load_folder(datasets, name, p, subset)
    return datasets.load_dataset(name, subset)


FOLDER_SUFFIXES = (".csv", ".tsv", ".json", ".parquet", ".arrow", ".txt", *JSONL_SUFFIXES)  # (a data file's, to users)


def _load_folder(datasets, name: str, p: Path, subset: str | None):
    """A folder of data files as datasets reads it (splits from the files' names), except that every data
    file in it must be read (datasets reads the most common kind only, and would drop the rest unsaid) and
    CSV or TSV cells are read as text, as a CSV file's are."""
    if any(c in str(p) for c in "*?["):  # (datasets finds a folder's files by patterns under it)
        raise DataError(f"dataset folder {name}: its path holds [, ], * or ?, which datasets reads as a "
                        "pattern; rename the folder, or link it from a path without them")
    builder = datasets.load_dataset_builder(str(p), subset)
    splits = {str(k): [str(f) for f in v] for k, v in (builder.config.data_files or {}).items()}
    read = {Path(f).resolve() for v in splits.values() for f in v}
    ignored = set(datasets.data_files.FILES_TO_IGNORE)
    # (a .txt file beside data of another kind is a licence or notes, not a dataset's lines)
    kinds = FOLDER_SUFFIXES if builder.name == "text" else tuple(k for k in FOLDER_SUFFIXES if k != ".txt")
    unread = sorted(f.relative_to(p) for f in p.rglob("*") if f.suffix.lower() in kinds and f.is_file()
                    and f.name not in ignored and not any(part.startswith((".", "__")) for part in
                                                          f.relative_to(p).parts) and f.resolve() not in read)
    suffixes = sorted({Path(f).suffix.lower() for f in read})
    if unread:
        raise DataError(f"dataset folder {name}: datasets would leave out {unread[0]}"
                        + (f" and {len(unread) - 1} more" if len(unread) > 1 else "")
                        + f" (it reads {len(read)} {'/'.join(suffixes)} file{'s' if len(read) > 1 else ''} as split "
                        f"{', '.join(splits)}); keep one kind of data file a folder, each named for its split "
                        "(train*, test*, ...) or none, or list each file as a dataset")
    if builder.name != "csv":
        return datasets.load_dataset(str(p), subset)
    if len(suffixes) > 1:
        raise DataError(f"dataset folder {name} mixes {' and '.join(suffixes)} files, whose cells are separated "
                        "differently; keep one kind a folder, or list each file as a dataset")
    files = [Path(f) for v in splits.values() for f in v]
    options = _csv_as_text(files[0], datasets)
    for f in files[1:]:
        _check_fields(f, options["delimiter"], len(options["features"]))
    return datasets.load_dataset("csv", data_files={k: [glob.escape(f) for f in v] for k, v in splits.items()},
                                 **options)


FINGERPRINT_PIECE = 1 << 16


def fingerprint(path) -> str | None:
    """A dataset's content in brief, for a resume to tell whether it changed: each data file's name and size
    and, in a folder of at most 64 of them, a hash of pieces of 64 KiB spread over it (16 a file, 2 or more in
    a folder): an edit, a shuffle, a file replaced; not one byte changed between the pieces, nor, in a larger
    folder, an edit that keeps a file's size. A folder's hidden files (``.cache``, ``.git``) and
    ``__``-named ones are not data: datasets skips them too. None for a Hub name, a path that is none, or a
    file that cannot be read (which reading the data says)."""
    import hashlib

    p = Path(path)
    try:
        files = [p] if p.is_file() else sorted(
            f for f in p.rglob("*") if f.is_file()
            and not any(part.startswith((".", "__")) for part in f.relative_to(p).parts)) if p.is_dir() else []
        if not files:
            return None
        pieces = 0 if len(files) > 64 else min(16, max(2, 64 // len(files)))
        h = hashlib.blake2b(digest_size=16)
        for f in files:
            size = f.stat().st_size
            h.update(f"{f.relative_to(p) if f != p else ''}\0{size}\0".encode())
            if pieces:
                with open(f, "rb") as fh:
                    for k in range(pieces):
                        fh.seek(max(0, size - FINGERPRINT_PIECE) * k // (pieces - 1))
                        h.update(fh.read(FINGERPRINT_PIECE))
        return h.hexdigest()
    except OSError:
        return None
