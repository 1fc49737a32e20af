"""Which slot each unit visit uses, and when its weights must start streaming in.

Pure functions of the model's shape and the window's size, so they are tested without a GPU.

One optimizer step visits units in this order (n decoder layers, L0..Ln-1):

    embed, L0, ..., Ln-1, head, Ln-1, ..., L0, embed
    |------ forward ------|  ^  |------ backward ------|
                          loss head: forward and backward at once

Every unit is updated at the end of the previous step, so its first visit in a step always loads.
A unit still resident from an earlier visit of this step is reused: with k layer slots, the last
k layers of the forward are still in the window when the backward starts.

The embedding's backward reads no weights (it scatters the hidden gradient into rows), so it never
loads: it only needs a gradient buffer. That lets an untied model's embedding and head share one
slot (``share_edge``): the head's weights replace the embedding's once its forward is done, and the
embedding's gradient goes into the same buffer after the head's has left for the host.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Visit:
    unit: int  # unit index (0 = embed, 1..n = layers, n+1 = head)
    phase: str  # "embed_fwd" | "fwd" | "head" | "bwd" | "embed_bwd"
    group: str  # slot group: "embed" | "layer" | "head" | "resident"
    slot: int  # slot index within the group
    load: bool  # weights must be copied in before this visit
    issue_after: int  # the load is enqueued after this visit's compute (-1: at step start)
    last: bool  # the unit's last visit this step: its gradient is complete afterwards


def step_visits(num_layers: int) -> list[tuple[int, str, str]]:
    n = num_layers
    seq = [(0, "embed_fwd", "embed")]
    seq += [(i + 1, "fwd", "layer") for i in range(n)]
    seq += [(n + 1, "head", "head")]
    seq += [(i + 1, "bwd", "layer") for i in reversed(range(n))]
    seq += [(0, "embed_bwd", "embed")]
    return seq


def plan_step(num_layers: int, layer_slots: int, prefetch_depth: int,
              resident: frozenset[int] = frozenset(), share_edge: bool = False,
              forward_only: bool = False) -> list[Visit]:
    """Assign slots (farthest-next-use eviction) and load points for one step.

    Units in ``resident`` never leave the GPU: each has its own slot (group "resident", slot = unit)
    and is never loaded during a step; the ring of layer slots serves the others. With ``share_edge``
    the head uses the embedding's group (one slot for both). ``forward_only``: the visits up to the loss
    head (evaluation), in the same slots.
    """
    if layer_slots < prefetch_depth + 1:
        raise ValueError(f"{layer_slots} layer slots cannot prefetch {prefetch_depth} visit(s) ahead")
    visits = step_visits(num_layers)[: num_layers + 2 if forward_only else None]
    seq = [(u, phase, "resident" if u in resident else "embed" if share_edge and g == "head" else g)
           for u, phase, g in visits]
    n_slots = {"embed": 1, "layer": layer_slots, "head": 1}
    holding: dict[str, list[int | None]] = {g: [None] * k for g, k in n_slots.items()}
    last_use: dict[str, list[int]] = {g: [-1] * k for g, k in n_slots.items()}

    def next_use(unit: int, after: int) -> int:
        for j in range(after + 1, len(seq)):
            if seq[j][0] == unit:
                return j
        return len(seq) + 1  # never again this step

    last_visit = {unit: j for j, (unit, _, _) in enumerate(seq)}
    plan = []
    for j, (unit, phase, group) in enumerate(seq):
        if group == "resident":
            plan.append(Visit(unit, phase, group, unit, False, -1, last_visit[unit] == j))
            continue
        slots = holding[group]
        if phase == "embed_bwd":  # no weights needed: the group's one slot, whatever it holds
            slot, load, issue = 0, False, -1
        elif unit in slots:
            slot, load = slots.index(unit), False
            issue = -1
        else:
            # With depth d the copy for visit j is enqueued right after visit j-d-1's compute, so it
            # runs while visits j-d..j-1 compute. The slot it overwrites must not be used after that
            # point (its last user's compute is enqueued first, and the copy waits for it on the GPU).
            # If no slot is free that early (a one-slot group in a very short model), issue later.
            issue = max(-1, j - prefetch_depth - 1, min(last_use[group]))
            free = [s for s in range(len(slots)) if last_use[group][s] <= issue]
            slot = max(free, key=lambda s: (slots[s] is None, next_use(slots[s], j) if slots[s] is not None else 0))
            load = True
            slots[slot] = unit
        last_use[group][slot] = j
        plan.append(Visit(unit, phase, group, slot, load, issue, last_visit[unit] == j))
    return plan


def next_update(units: list[int], ready: list[bool], background: list[bool] | None = None) -> int:
    """Which pending optimizer job to run next (an index into ``units``, oldest first).

    The lowest unit whose gradient has landed: the next forward consumes units in increasing order,
    so this lets it start as early as possible. ``background`` jobs (the embedding's rows a step did
    not touch, due only by the next step) run when no other job can run or wait. If none is ready, the oldest job
    (index 0), whose gradient copy was enqueued first and so finishes first. The caller marks a job not
    ready while an older one of its unit is pending: a unit's jobs run in the order they came.
    """
    background = background or [False] * len(units)
    landed = [i for i, r in enumerate(ready) if r and not background[i]]
    if landed:
        return min(landed, key=lambda i: units[i])
    # A due job whose gradient is still in flight comes before a background one: it lands within a copy's
    # time, and the next forward may wait for it (the embedding's touched rows at the step boundary), while
    # a background job takes as long as a layer's update.
    due = [i for i, u in enumerate(units) if not background[i] and u not in units[:i]]
    if due:
        return due[0]
    return next((i for i, r in enumerate(ready) if r), 0)
