"""The window plan is a pure function: which slot each visit uses and when its weights load."""
import pytest

from slideformer.window.schedule import next_update, plan_step, step_visits


def test_visit_order():
    seq = [(u, p) for u, p, _ in step_visits(3)]
    assert seq == [(0, "embed_fwd"), (1, "fwd"), (2, "fwd"), (3, "fwd"), (4, "head"),
                   (3, "bwd"), (2, "bwd"), (1, "bwd"), (0, "embed_bwd")]


@pytest.mark.parametrize("share_edge", [False, True])
@pytest.mark.parametrize("n,slots,depth", [(1, 2, 1), (1, 3, 2), (4, 2, 1), (8, 3, 1), (8, 3, 2), (32, 4, 3), (36, 2, 1)])
def test_plan_invariants(n, slots, depth, share_edge):
    plan = plan_step(n, slots, depth, share_edge=share_edge)
    resident = {}
    for j, v in enumerate(plan):
        key = (v.group, v.slot)
        if v.load:
            # the load is enqueued before the visit, no more than depth+1 visits early
            assert v.issue_after < j and v.issue_after >= j - depth - 1
            # nothing uses the slot between the load's issue point and the visit
            assert all((w.group, w.slot) != key for w in plan[v.issue_after + 1: j])
            resident[key] = v.unit
        if v.phase == "embed_bwd":  # needs the slot's gradient buffer only, never its weights
            assert not v.load and v.group == "embed"
        else:
            assert resident.get(key) == v.unit, f"visit {j} computes on a slot holding another unit"
    # every unit loads at least once (each was updated at the end of the previous step)
    assert {v.unit for v in plan if v.load} == set(range(n + 2))
    # the last `slots` layers of the forward stay resident for the backward
    reloads = sum(v.load for v in plan if v.phase == "bwd")
    assert reloads == max(0, n - slots)
    # the last visit of each unit is flagged once
    assert sorted(v.unit for v in plan if v.last) == list(range(n + 2))


def test_shared_edge_slot_holds_embedding_then_head():
    plan = plan_step(4, 2, 1, share_edge=True)
    edge = [(v.phase, v.load) for v in plan if v.group == "embed"]
    assert edge == [("embed_fwd", True), ("head", True), ("embed_bwd", False)]
    assert not any(v.group == "head" for v in plan)
    head = next(v for v in plan if v.phase == "head")
    assert head.issue_after >= 0  # the head's weights overwrite the embedding's only after its forward


def test_too_small_window_is_refused():
    with pytest.raises(ValueError, match="cannot prefetch"):
        plan_step(4, 2, 2)


def test_next_update_prefers_the_lowest_landed_unit():
    assert next_update([5, 4, 3], [True, True, False]) == 1  # unit 4: landed and needed before 5
    assert next_update([5, 4, 3], [False, False, False]) == 0  # none landed: wait for the oldest copy
    assert next_update([0, 9], [True, True]) == 0
    # the embedding's untouched rows wait for every other job, ready or still landing (the oldest first)
    assert next_update([0, 9], [True, True], background=[True, False]) == 1
    assert next_update([0, 9], [True, False], background=[True, False]) == 1
    assert next_update([3, 0, 9], [False, True, False], background=[False, True, False]) == 0
    # but not for a job of their own unit queued after them (a unit's jobs run in the order they came)
    assert next_update([0, 0], [True, False], background=[True, False]) == 0
    assert next_update([0], [True], background=[True]) == 0


def test_resident_units_never_load_and_leave_the_ring_to_the_others():
    n = 8
    resident = frozenset({6, 7, 8})  # the last three layers (units 6..8)
    plan = plan_step(n, 2, 1, resident)
    for v in plan:
        if v.unit in resident:
            assert v.group == "resident" and v.slot == v.unit and not v.load
        else:
            assert v.group != "resident"
    # the ring serves layers 0..4 (units 1..5): they load in forward; in backward the last two stay
    assert sum(v.load for v in plan if v.phase == "bwd") == 5 - 2
