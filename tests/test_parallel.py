"""Data parallel (parallel.py): N processes on gloo, each training its rows of every global batch, train
the model one process trains on the whole batch; each rank keeps only the units it owns."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slideformer.config import ConfigError
from slideformer.parallel import assign_units

from test_engine_parity import assert_same, reference_train
from tiny import batch, build, engine_config


def test_units_are_assigned_largest_first_to_the_least_loaded_rank():
    owner = assign_units([100, 10, 10, 10, 100, 30], 2)
    assert owner == [0, 1, 1, 1, 1, 0]  # 100 + 30 against 100 + 10 + 10 + 10
    assert assign_units([5, 5, 5], 3) == [0, 1, 2]
    assert assign_units([7], 1) == [0]


def _rows(b: dict, rank: int, world: int, micro: int) -> list[dict]:
    """This rank's rows of a global batch (rank, rank + world, ...), as ``micro`` micro-batches."""
    mine = {k: v[rank::world] for k, v in b.items()}
    n = mine["input_ids"].shape[0]
    cuts = [range(n)[i::micro] for i in range(micro)]
    return [{k: v[list(c)] for k, v in mine.items()} for c in cuts if len(c)]


def _rank(rank: int, world: int, init: str, family: str, cfg: dict, micro: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        from slideformer import SlideEngine

        model = build(family)
        batches = [batch(model.config.vocab_size, b=6, seed=s) for s in range(3)]
        with SlideEngine(model, engine_config(device="cpu", **cfg)) as eng:
            losses = [eng.train_step(_rows(b, rank, world, micro)) for b in batches]
            state = {k: v.clone() for k, v in eng.state_dict().items()}
            norm = eng.last_grad_norm
            try:
                eng.save_checkpoint(os.path.join(os.path.dirname(out), f"ck{rank}"))
                refused = None
            except ConfigError as e:
                refused = str(e)
            host = eng.store.bytes_by_category()["master"]
        torch.save({"losses": losses, "state": state, "norm": norm, "refused": refused, "host": host}, out)
    finally:
        dist.destroy_process_group()


def run_ranks(tmp_path, world: int, family: str, cfg: dict, micro: int = 1) -> list[dict]:
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp_path / "init"), family, cfg, micro, outs[r]))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    return [torch.load(o) for o in outs]


@pytest.mark.parametrize("world,family,cfg,micro", [
    (2, "llama", dict(max_grad_norm=0.05, weight_decay=0.1), 2),  # clipping, accumulation, decay; untied
    (3, "qwen3-tied", dict(resident_layers=1, window_slots=2, prefetch_depth=1), 1),  # a GPU-trained layer; tied
])
def test_ranks_train_the_global_batch_as_one_process(tmp_path, world, family, cfg, micro):
    cfg = dict(lr=1e-2, loss_kernel="torch", compute_dtype=torch.float32, **cfg)
    results = run_ranks(tmp_path, world, family, cfg, micro)
    model = build(family)
    batches = [batch(model.config.vocab_size, b=6, seed=s) for s in range(3)]
    ref, ref_losses = reference_train(model, batches, lr=1e-2, max_grad_norm=cfg.get("max_grad_norm"),
                                      weight_decay=cfg.get("weight_decay", 0.0))
    keys = set(ref.state_dict()) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    seen = set()
    for res in results:  # each rank: the same losses and norm, and the exact state of the units it owns
        assert_same(res["state"], ref, res["losses"], ref_losses)
        assert res["norm"] == pytest.approx(results[0]["norm"], rel=1e-6)
        assert "not built yet" in res["refused"]
        seen |= set(res["state"])
    assert seen == keys
    # the host state is split, not copied: the ranks' masters together are one process's
    from slideformer import SlideEngine

    with SlideEngine(model, engine_config(device="cpu", **cfg)) as one:
        assert sum(r["host"] for r in results) == one.store.bytes_by_category()["master"]
    assert all(0 < r["host"] for r in results)
