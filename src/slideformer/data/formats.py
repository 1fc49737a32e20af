"""Records from local files, in the formats users bring, rendered into token ids and labels.

Every format becomes a list of chat messages, rendered with the tokenizer's chat template; the loss is
on the assistant turns only (labels -100 elsewhere). Plain text is trained on whole. Supported:
- alpaca:   {"instruction", "input"?, "output", "system"?}
- sharegpt: {"conversations": [{"from": "human"|"gpt"|"system", "value"}]}
- messages: {"messages": [{"role": "user"|"assistant"|"system", "content"}]}  (OpenAI style)
- text:     {"text"}
Files: JSONL, JSON (a list of records) and Parquet (through ``datasets``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

FORMATS = ("alpaca", "sharegpt", "messages", "text")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class DataError(ValueError):
    """A malformed record; the message names the file and line (or record index)."""


def read_records(path: str | os.PathLike) -> list[tuple[str, dict]]:
    """(where, record) pairs; ``where`` is "file:line" for JSONL, "file[record i]" otherwise."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset file {p} does not exist")
    if p.suffix == ".parquet":
        try:
            from datasets import Dataset
        except ImportError:
            raise DataError(f"{p}: reading Parquet needs the datasets package: pip install 'slideformer[data]' "
                            "(or pip install datasets)") from None

        return [(f"{p}[record {i}]", dict(r)) for i, r in enumerate(Dataset.from_parquet(str(p)))]
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(data, list):
            raise DataError(f"{p}: a .json dataset must be a list of records")
        return [(f"{p}[record {i}]", r) for i, r in enumerate(data)]
    out = []
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((f"{p}:{lineno}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
    return out


def detect_format(rec: dict, where: str) -> str:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "messages" in rec:
        return "messages"
    if "conversations" in rec:
        return "sharegpt"
    if "instruction" in rec and "output" in rec:
        return "alpaca"
    if "text" in rec:
        return "text"
    raise DataError(f"{where}: cannot tell the format from keys {sorted(rec)}; expected one of "
                    "messages / conversations / instruction+output / text, or set the dataset's format")


def to_messages(rec: dict, fmt: str, where: str) -> list[dict] | str:
    """Chat messages for chat formats; the raw string for "text"."""
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
        user = rec["instruction"] + (f"\n{rec['input']}" if rec.get("input") else "")
        msgs = [{"role": "system", "content": rec["system"]}] if rec.get("system") else []
        return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": rec["output"]}]
    if fmt == "sharegpt":
        conv = rec.get("conversations")
        need(isinstance(conv, list) and conv, "needs a non-empty list 'conversations'")
        msgs = []
        for i, turn in enumerate(conv):
            need(isinstance(turn, dict) and turn.get("from") in SHAREGPT_ROLES and isinstance(turn.get("value"), str),
                 f"turn {i} needs 'from' in {sorted(SHAREGPT_ROLES)} and a string 'value'")
            msgs.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
        return msgs
    if fmt == "messages":
        msgs = rec.get("messages")
        need(isinstance(msgs, list) and msgs, "needs a non-empty list 'messages'")
        for i, m in enumerate(msgs):
            need(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str),
                 f"message {i} needs 'role' in system/user/assistant and a string 'content'")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    raise DataError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)} or auto")


def render(rec_messages, tokenizer, where: str) -> tuple[list[int], list[int]]:
    """Token ids and labels: assistant turns (and their end markers) are trained on, the rest is -100."""
    if isinstance(rec_messages, str):
        ids = tokenizer(rec_messages, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return ids, list(ids)
    msgs = rec_messages
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: the conversation has no assistant turn to train on")
    def tok(prefix, gen):
        out = tokenizer.apply_chat_template(prefix, tokenize=True, add_generation_prompt=gen)
        out = list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5
        if out[: len(ids)] != ids:
            raise DataError(f"{where}: the chat template renders a conversation prefix differently from the "
                            "whole; slideformer needs prefix-stable templates")
        return out

    ids: list[int] = []
    labels: list[int] = []
    # Render growing prefixes and attribute the new tokens to the newest message: this follows whatever
    # the tokenizer's template does around turns, without parsing it. An assistant turn's header (what
    # add_generation_prompt adds) is prompt, not target.
    for k in range(1, len(msgs) + 1):
        if msgs[k - 1]["role"] == "assistant":
            header = tok(msgs[: k - 1], True)
            full = tok(msgs[:k], False)
            start = len(header) if full[: len(header)] == header else len(ids)
            labels += [-100] * (start - len(ids)) + full[start:]
        else:
            full = tok(msgs[:k], False)
            labels += [-100] * (len(full) - len(ids))
        ids = full
    return ids, labels
