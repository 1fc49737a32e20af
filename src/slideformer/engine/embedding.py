"""The embedding's CPU update by rows.

Streamed through the window, an untied embedding is the last gradient of a step and the first weights
of the next, so its whole CPU update stands between one step's backward and the next one's forward.
Yet a step's tokens touch few of its rows (a 32k-token step at most a quarter of a 128k vocabulary,
text far fewer), and every other row's gradient is exactly zero. So the update runs in two parts
(optim/adamw.py ``Rows``; together one AdamW step, to the bit):
- the rows the step did not touch, with a zero gradient, early: queued at the step's embedding visit
  and run by the CPU optimizer while nothing else is ready (the GPU is busy with the forward then).
  Their update needs no gradient, and nothing reads those rows before the next step: the step's load
  was of its own rows only, gathered on the host before this part is queued;
- the touched rows, after backward: their gradient is summed on the GPU into a packed [rows, hidden]
  block, sent to the host (not [vocab, hidden]), and updated as it lands.
With clipping both wait for the verdict (a dropped step must leave every row as it was), the untouched
rows first, and the gain is only the packed gradient.

Tied to the lm_head, the matrix's gradient is dense, but an untouched row's is the head's alone, and
the head's gradient is complete when backward begins. So there:
- the head's whole gradient goes to the host at the loss head, and the untouched rows update from it at
  their own places while backward runs (their part of the global norm counted then);
- at the embedding's backward the touched rows' head gradient is gathered into a packed block, their
  embedding part added, and that block is sent and updated as above.
The step's load is its rows, as untied; the whole matrix, which the head reads, is loaded over them after
the embedding's forward, while the first layers compute. Under clipping the tied update stays
whole: its rows would wait for the verdict anyway, and the head's gradient would hold the unit's one
host buffer until then, which the touched rows' gradient needs.
``plan.memory.embedding_by_rows`` decides where this applies; the torch backend has no row kernel, and
keeps the whole update.
"""
from __future__ import annotations

import torch


def step_rows(ids: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The step's touched rows (sorted, unique) and, for each micro-batch's token ids, (its unique rows,
    each position's index into them, their places among the step's rows): host tensors, no GPU sync."""
    per = [torch.unique(t.long().flatten(), return_inverse=True) for t in ids]
    rows = torch.unique(torch.cat([r for r, _ in per])) if per else torch.empty(0, dtype=torch.long)
    return rows, [(r, where, torch.searchsorted(rows, r)) for r, where in per]

