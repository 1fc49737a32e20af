"""Reading records and rendering them into (ids, labels) with the loss on the response only."""
from __future__ import annotations

import json
import os
from pathlib import Path


class DataError(ValueError):
    """A malformed record; the message names the file and line."""


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{Path(path)}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(rec, dict):
                raise DataError(f"{Path(path)}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            rec["_where"] = f"{Path(path)}:{lineno}"
            out.append(rec)
    return out


def render_alpaca(rec: dict, tokenizer, eos_id: int) -> tuple[list[int], list[int]]:
    """Prompt tokens get label -100; the response and the end-of-sequence token are trained on."""
    for key in ("instruction", "output"):
        if not isinstance(rec.get(key), str):
            raise DataError(f"{rec.get('_where', 'record')}: alpaca record needs a string {key!r}")
    prompt = f"### Instruction:\n{rec['instruction']}\n"
    if rec.get("input"):
        prompt += f"{rec['input']}\n"
    prompt += "### Response:\n"
    p = tokenizer.encode(prompt).ids
    r = tokenizer.encode(rec["output"]).ids + [eos_id]
    return p + r, [-100] * len(p) + r
