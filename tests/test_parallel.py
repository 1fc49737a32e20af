"""Data parallel (parallel.py): N processes on gloo, each training its rows of every global batch, train
the model one process trains on the whole batch; each rank keeps only the units it owns."""

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slideformer.parallel import assign_units

from test_engine_parity import assert_same, reference_noise, reference_train
from tiny import batch, build, children, engine_config


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


def _rank(rank: int, world: int, init: str, family: str, cfg: dict, micro: int, out: str, steps: list[int],
          resume: str | None, save: str | None, backend: str = "gloo") -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (loopback, whatever the host's name resolves to)
    if backend == "nccl":  # one GPU a rank, as torchrun's LOCAL_RANK gives it (train/loop.py)
        import datetime
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        res = train_steps(family, cfg, steps, rank, world, micro, resume, save)
        torch.save(res, out)
    finally:
        dist.destroy_process_group()
    _end_rank()


def _end_rank() -> None:
    """A rank's process ends as the CLI ends one (train/launch.py ``end_rank``): past the interpreter's
    finalization, during which a gloo thread still releasing a finished collective can abort or hang it."""
    from slideformer.train.launch import end_rank

    end_rank(0)


def train_steps(family: str, cfg: dict, steps: list[int], rank: int = 0, world: int = 1, micro: int = 1,
                resume: str | None = None, save: str | None = None) -> dict:
    """The engine over ``steps`` of the global batches batch(b=6, seed=s), this rank's rows of each; from the
    checkpoint ``resume``, and saved to ``save`` (with an export beside it) at the end."""
    from slideformer import SlideEngine

    model = build(family)
    with SlideEngine(model, engine_config(**{"device": "cpu", **cfg})) as eng:
        if resume:
            eng.load_checkpoint(resume)
        losses = [eng.train_step(_rows(batch(model.config.vocab_size, b=6, seed=s), rank, world, micro))
                  for s in steps]
        state = {k: v.clone() for k, v in eng.state_dict().items()}
        if save:
            eng.save_checkpoint(save)
            eng.save_pretrained(save + "-export")
        return {"losses": losses, "state": state, "norm": eng.last_grad_norm,
                "host": eng.store.bytes_by_category(), "tier": len(eng.store.nvme_units)}


def run_ranks(tmp_path, world: int, family: str, cfg: dict, micro: int = 1, steps=(0, 1, 2), resume=None,
              save=None, backend: str = "gloo") -> list[dict]:
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, world, str(tmp_path / f"init{world}"), family, cfg, micro, outs[r],
                                             list(steps), resume, save, backend)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"a rank exited with {p.exitcode}"
    return [torch.load(o) for o in outs]


def reference(family: str, cfg: dict, steps=(0, 1, 2), noise: bool = False, world: int = 1, micro: int = 1):
    """PyTorch's training on the global batches; ``noise``: its own noise instead (``reference_noise``), and
    its training on the micro-batches the ``world`` ranks' ``micro`` make of them, in reverse order (the
    engine's shapes of products, summed otherwise)."""
    model = build(family)
    batches = [batch(model.config.vocab_size, b=6, seed=s) for s in steps]
    kw = dict(lr=cfg["lr"], max_grad_norm=cfg.get("max_grad_norm"), weight_decay=cfg.get("weight_decay", 0.0))
    if not noise:
        return reference_train(model, batches, **kw)
    as_ranks = [[m for r in range(world) for m in _rows(b, r, world, micro)][::-1] for b in batches]
    return reference_noise(model, batches, **kw) + [reference_train(model, as_ranks, **kw)[0]]


BASE = dict(lr=1e-2, loss_kernel="torch", compute_dtype=torch.float32)


@pytest.mark.parametrize("world,family,cfg,micro", [
    (2, "llama", dict(max_grad_norm=0.05, weight_decay=0.1), 2),  # clipping, accumulation, decay; untied
    (3, "qwen3-tied", dict(resident_layers=1, window_slots=2, prefetch_depth=1), 1),  # a GPU-trained layer; tied
    (2, "llama", dict(offload_dir="TMP", nvme_fraction=1.0, max_grad_norm=0.05), 1),  # each rank's NVMe tier
    # the router's load-balancing loss over the global batch, against one process of the engine (the engine's
    # MoE parity with transformers is test_moe.py's)
    (2, "qwen3-moe", dict(max_grad_norm=0.05), 2),
])
def test_ranks_train_the_global_batch_as_one_process(tmp_path, world, family, cfg, micro):
    cfg = {**BASE, **cfg}
    if cfg.get("offload_dir") == "TMP":
        cfg["offload_dir"] = str(tmp_path / "nvme")
    results = run_ranks(tmp_path, world, family, cfg, micro, save=str(tmp_path / "ck"))
    ref, ref_losses = reference(family, cfg)
    noise = reference(family, cfg, noise=True, world=world, micro=micro)
    model = build(family)
    if family.endswith("moe"):  # (the router's loss is the whole batch's: the engine's own rows apart for noise)
        one, apart = train_steps(family, cfg, [0, 1, 2]), train_steps(family, cfg, [0, 1, 2], micro=6)
        ref, ref_losses, noise = build(family), one["losses"], build(family)
        ref.load_state_dict(one["state"], strict=False)
        noise.load_state_dict(apart["state"], strict=False)
    keys = set(ref.state_dict()) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    seen = set()
    for res in results:  # each rank: the same losses and norm, and the state of the units it owns
        assert_same(res["state"], ref, res["losses"], ref_losses, noise)
        assert res["norm"] == pytest.approx(results[0]["norm"], rel=1e-6)
        seen |= set(res["state"])
    assert seen == keys
    # the host state is split, not copied: the ranks' masters together are one process's
    from slideformer import SlideEngine

    from slideformer.plan import Layout, ModelShape
    from slideformer.plan.memory import config_rank_host_bytes

    with SlideEngine(model, engine_config(device="cpu", **cfg)) as one:
        assert sum(r["host"]["master"] for r in results) == one.store.bytes_by_category()["master"]
        # and as the planner counts each rank's (plan/memory.py rank_host_bytes)
        sh = replace(ModelShape.from_adapter(one.adapter), ranks=world)
        planned = config_rank_host_bytes(one.cfg, sh, 0, 1, Layout.of(one.cfg))
    for r, res in enumerate(results):
        assert {k: res["host"][k] for k in ("master", "moments", "weights", "grads", "spares")} == \
            {k: planned[r][k] for k in ("master", "moments", "weights", "grads", "spares")}, r
    assert all(0 < r["host"]["master"] for r in results)
    if cfg.get("offload_dir"):  # every layer's moments on some rank's tier, each layer on one
        assert sum(r["tier"] for r in results) == model.config.num_hidden_layers
    # the export, each rank writing its units' files, loads in transformers as the trained model
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ck-export"), dtype=torch.float32)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[k], v, rtol=0, atol=1e-4)


def test_ranks_in_fp8_train_as_one_process_in_fp8(tmp_path):
    """FP8 scales each token's row on its own, so two ranks train as one process does in FP8, each rank's
    casts made of the weights its slots were sent (a broadcast moves no version counter)."""
    cfg = {**BASE, "fp8": True, "window_slots": 2, "prefetch_depth": 1}
    results = run_ranks(tmp_path, 2, "llama", cfg, 1, steps=(0, 1, 2, 3))
    one = train_steps("llama", cfg, [0, 1, 2, 3])
    for res in results:
        assert res["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=0)
        for k, v in res["state"].items():
            # (a rank's weight gradients sum 3 rows, one process's 6: fp32 rounding apart; stale casts moved
            # the losses by 0.3% at step 3)
            torch.testing.assert_close(v, one["state"][k], rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    dict(max_grad_norm=0.05, weight_decay=0.1),  # the streamed units' weights shared, gradients reduced, clipping
    dict(resident_layers=1, window_slots=2, prefetch_depth=1),  # a layer trained on the GPU: its gradient summed
])
def test_ranks_on_the_gpu_train_the_global_batch_as_one_process(tmp_path, cfg):
    """The collectives in order with the window's CUDA streams: 2 ranks on one GPU (gloo: NCCL refuses two
    ranks on one device) against one process on it, fp32, with accumulation. The bound is the one process's
    own noise on the GPU: its distance to itself with the batch in 1 or 3 micro-batches instead of 2 (on the
    H200 the ranks are at most 1.3x that, its largest 1.1e-4)."""
    cfg = {**BASE, **cfg, "device": "cuda"}
    _against_one_process(run_ranks(tmp_path, 2, "llama", cfg, micro=2), cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("cfg", [
    dict(max_grad_norm=0.05, weight_decay=0.1),
    dict(resident_layers=1, window_slots=2, prefetch_depth=1),
])
def test_ranks_on_two_gpus_over_nccl_train_the_global_batch_as_one_process(tmp_path, cfg):
    """The same over NCCL, one GPU a rank: broadcast, reduce (not all_reduce), and the object collectives of a
    checkpoint's save."""
    cfg = {**BASE, **cfg, "device": "cuda"}
    results = run_ranks(tmp_path, 2, "llama", cfg, micro=2, backend="nccl", save=str(tmp_path / "ck"))
    _against_one_process(results, cfg)


def _against_one_process(results, cfg):
    """Each rank's state within twice one process's own micro-batch-reorder noise, on the same device."""
    one = train_steps("llama", cfg, [0, 1, 2], micro=2)
    others = [train_steps("llama", cfg, [0, 1, 2], micro=m) for m in (1, 3)]

    def rel(a, b):
        return float((a.cpu() - b.cpu()).norm() / b.cpu().norm())

    # the last step's gradient norm within twice the same noise (on the H200 the ranks' distance was 1.1e-5)
    norm_noise = max(abs(o["norm"] - one["norm"]) for o in others)
    seen = set()
    for res in results:
        for k, v in res["state"].items():
            noise = max(rel(o["state"][k], one["state"][k]) for o in others)
            assert rel(v, one["state"][k]) <= 2 * noise, f"{k}: {rel(v, one['state'][k]):.2e} against noise {noise:.2e}"
            seen.add(k)
        assert res["losses"] == pytest.approx(one["losses"], rel=1e-6)
        assert abs(res["norm"] - one["norm"]) <= 2 * norm_noise, (res["norm"], one["norm"], norm_noise)
    assert seen == set(one["state"])


@pytest.mark.parametrize("before,after", [(2, 1), (1, 3)])
def test_a_checkpoint_of_n_ranks_resumes_under_m(tmp_path, before, after):
    """Step 0 (and 1) under ``before`` ranks, saved; the rest under ``after`` from that checkpoint: the
    training of one process over all three steps, with clipping."""
    cfg = {**BASE, "max_grad_norm": 0.05}
    split = 2 if before == 2 else 1
    ck = str(tmp_path / "ck")
    first = run_ranks(tmp_path, before, "llama", cfg, steps=range(split), save=ck) if before > 1 else \
        [train_steps("llama", cfg, list(range(split)), save=ck)]
    rest = run_ranks(tmp_path, after, "llama", cfg, steps=range(split, 3), resume=ck) if after > 1 else \
        [train_steps("llama", cfg, list(range(split, 3)), resume=ck)]
    ref, ref_losses = reference("llama", cfg)
    noise = reference("llama", cfg, noise=True)
    for res in rest:
        assert_same(res["state"], ref, first[0]["losses"] + res["losses"], ref_losses, noise)


def _trainer_rank(rank: int, world: int, port: int, overrides: list[str], out: str, config: str | None = None) -> None:
    """One torchrun rank of `slideformer train` (torchrun's environment, set by hand), of ``config`` (a YAML
    file) with ``overrides``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    from slideformer.train.config import load_config
    from slideformer.train.loop import train

    r = train(load_config(config, overrides))
    torch.save({"losses": [h["loss"] for h in r["history"]], "checkpoint": r["checkpoint"], "evals": r["evals"]},
               out)
    _end_rank()


def torchrun_job(target, args_of, timeout: float = 300) -> list:
    """Two processes as torchrun would start them on loopback: ``target(*args_of(rank, port))``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    return procs


def two_trainers(tmp_path, overrides: list[str]) -> list[dict]:
    """`slideformer train` on 2 ranks (output_dir tmp_path/two); what each returned."""
    outs = [str(tmp_path / f"t{r}.pt") for r in range(2)]
    procs = torchrun_job(_trainer_rank, lambda r, port: (r, 2, port, overrides + [f"output_dir={tmp_path / 'two'}"],
                                                         outs[r]))
    assert [p.exitcode for p in procs] == [0, 0]
    return [torch.load(o) for o in outs]


def test_the_trainer_under_torchrun_trains_as_one_process_with_the_global_batch(tmp_path):
    """2 ranks of micro_batch_size 2 (and accumulation) against one process of micro_batch_size 4: the same
    samples each step, the same losses, one checkpoint (rank 0 logs; each rank writes its units) with the
    weights of the single process's; and the same held-out loss, each rank evaluating its rows of each batch
    (9 samples held out: batches of 4, 4 and a last one of 1, which each rank evaluates whole)."""
    from safetensors.torch import load_file

    from slideformer.train.config import load_config
    from slideformer.train.loop import train

    common = ["progress=false", "device=cpu", "logging_steps=1", "max_steps=4", "save_steps=2",
              "gradient_accumulation_steps=2", "max_grad_norm=1.0", "val_size=0.1"]
    one = train(load_config(None, common + ["micro_batch_size=4", f"output_dir={tmp_path / 'one'}"]))
    two = two_trainers(tmp_path, common + ["micro_batch_size=2"])
    ref = [h["loss"] for h in one["history"]]
    for res in two:
        assert res["losses"] == pytest.approx(ref, rel=1e-5)
        assert len(res["evals"]) == len(one["evals"]) == 1
        assert res["evals"][0]["eval_tokens"] == one["evals"][0]["eval_tokens"]
        assert res["evals"][0]["eval_loss"] == pytest.approx(one["evals"][0]["eval_loss"], rel=1e-5)
    metrics = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 5  # rank 0 alone logs: 4 steps and the evaluation
    a, b = (tmp_path / "one" / "checkpoint-4"), (tmp_path / "two" / "checkpoint-4")
    for f in (a / "state").glob("*.safetensors"):
        if f.stem != "trainer":
            got, want = load_file(str(b / "state" / f.name))["master"], load_file(str(f))["master"]
            assert float((got - want).norm() / want.norm()) <= 1e-5, f.name  # (assert_same's bounds: fp32 noise)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert sorted(p.name for p in (tmp_path / "two").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def _faulty_rank(rank: int, port: int, overrides: list[str], out: str, fault: str) -> None:
    """`slideformer train` as torchrun's rank ``rank`` of 2. Rank 1, during its second step: ``fault`` "die"
    (os._exit mid-backward), "hang" (20 s without a word) or "term" (a SIGTERM to itself alone)."""
    import signal
    import sys
    import time

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    from slideformer.cli import main
    from slideformer.engine import engine as engine_mod

    if rank == 1:
        step = engine_mod.SlideEngine._gradient_done
        calls = []

        def fail(self, st, unit, slot):
            calls.append(unit)
            if len(calls) == 7:  # (the second step, part-way through its backward)
                if fault == "die":
                    os._exit(9)
                if fault == "hang":
                    time.sleep(20)
                else:
                    os.kill(os.getpid(), signal.SIGTERM)
            return step(self, st, unit, slot)
        engine_mod.SlideEngine._gradient_done = fail
    with open(out, "w") as f:
        sys.stderr = sys.stdout = f
        code = main(["train"] + overrides)
        f.write(f"\nexit {code}\n")
    _end_rank()


def faulty_job(tmp_path, fault: str, overrides: list[str], timeout: float = 300) -> list:
    outs = [str(tmp_path / f"out{r}.txt") for r in range(2)]
    procs = torchrun_job(_faulty_rank, lambda r, port: (r, port, overrides, outs[r], fault), timeout)
    return procs, [open(o).read() if os.path.exists(o) else "" for o in outs]


FAULT = ["progress=false", "device=cpu", "max_steps=4", "micro_batch_size=2"]


def test_a_rank_that_dies_mid_step_ends_the_job_with_one_line_on_the_others(tmp_path):
    procs, texts = faulty_job(tmp_path, "die", FAULT + [f"output_dir={tmp_path / 'o'}"])
    assert procs[1].exitcode == 9
    lines = [ln for ln in texts[0].splitlines() if ln.strip()]
    assert lines[-1] == "exit 7", texts[0]
    assert "lost the others" in lines[-2] and "rank 0 of 2" in lines[-2] and "Traceback" not in texts[0]


def test_a_rank_that_hangs_ends_the_job_through_the_watchdog(tmp_path):
    """Rank 1 stops answering mid-step (20 s), rank 0 waits for it in a collective: a watchdog (4 s here)
    ends the job long before rank 1 wakes. Whichever fires first exits 6 with its line and every thread's
    stack; rank 0 then ends with its own watchdog's (6) or, once rank 1 is gone, the lost-rank line (7)."""
    import time

    t0 = time.monotonic()
    procs, texts = faulty_job(tmp_path, "hang", FAULT + [f"output_dir={tmp_path / 'o'}", "watchdog_seconds=4"])
    assert time.monotonic() - t0 < 20 + 10
    fired = [r for r in (0, 1) if procs[r].exitcode == 6 or texts[r].rstrip().endswith("exit 6")]
    assert fired, texts
    for r in fired:
        assert "no progress for" in texts[r] and "another rank did not finish" in texts[r]
    lines = [ln for ln in texts[0].splitlines() if ln.strip()]
    assert 0 in fired or (lines[-1] == "exit 7" and "lost the others" in lines[-2]), texts[0]


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step_with_one_checkpoint(tmp_path):
    procs, texts = faulty_job(tmp_path, "term", FAULT + [f"output_dir={tmp_path / 'o'}"])
    for text in texts:  # each rank: exit 143 (128 + SIGTERM)
        assert text.splitlines()[-1] == "exit 143", text
    assert "SIGTERM: stopped after step 2" in texts[0]
    assert [p.name for p in (tmp_path / "o").glob("checkpoint-*")] == ["checkpoint-2"]


def test_packed_rows_of_an_epochs_tail_train_as_one_process(tmp_path):
    """Packing: the last micro-batches of an epoch hold rows of padding only, which some ranks get; the
    step's target count is the global one, so they train on as one process does."""
    from slideformer.train.config import load_config
    from slideformer.train.loop import train

    common = ["progress=false", "device=cpu", "logging_steps=1", "packing=true", "cutoff_len=256",
              "max_steps=8", "max_grad_norm=1.0"]  # (the bundled data's first epoch ends at step 5)
    one = train(load_config(None, common + ["micro_batch_size=4", f"output_dir={tmp_path / 'one'}"]))
    losses = two_trainers(tmp_path, common + ["micro_batch_size=2"])[0]["losses"]
    assert [h["epoch"] <= 1 for h in one["history"]][4:6] == [True, False]
    assert losses == pytest.approx([h["loss"] for h in one["history"]], rel=1e-5)


def test_two_nodes_meeting_through_torchruns_rendezvous_train_as_one_process(tmp_path):
    """torchrun itself, as two nodes of one process each that meet through its c10d rendezvous on loopback:
    each process is its host's only one (LOCAL_WORLD_SIZE 1 of WORLD_SIZE 2), so its host share, threads
    and device are a node's, while the batch, the collectives and the checkpoint are the job's. The same
    losses as one process with the global batch, logged once, and one checkpoint."""
    import json
    import signal
    import socket
    import subprocess
    import sys
    import time

    from slideformer.train.config import load_config
    from slideformer.train.loop import train

    t0 = time.monotonic()
    common = ["progress=false", "device=cpu", "logging_steps=1", "max_steps=3", "save_steps=3",
              "gradient_accumulation_steps=2", "max_grad_norm=1.0"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # (PYTHONFAULTHANDLER: a worker that hangs prints every thread's stack on the SIGABRT below)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    logs = [str(tmp_path / f"node{i}.log") for i in range(2)]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes",
         "-m", "slideformer", "train", *common, "micro_batch_size=2", f"output_dir={tmp_path / 'two'}"],
        env=env, cwd=tmp_path, stdout=open(log, "w"), stderr=subprocess.STDOUT) for log in logs]
    # An agent whose workers are done waits up to 300 s (torchrun's exit barrier, not settable) for the other
    # agent: what a worker that does not exit looks like, and what a lost barrier message looks like too
    # (pytorch/pytorch#69520). So a node may take longer than that; one that takes longer still has a
    # worker that hangs: its stacks, and both logs, are the failure's message.
    try:
        for n in nodes:
            n.wait(timeout=max(1.0, 420 - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        for n in nodes:
            for child in children(n.pid):
                try:
                    os.kill(child, signal.SIGABRT)
                except ProcessLookupError:  # (it ended meanwhile)
                    pass
        time.sleep(5)
        for n in nodes:
            n.kill()
            n.wait()
    logs = [open(log).read() for log in logs]
    assert [n.returncode for n in nodes] == [0, 0], logs
    one = train(load_config(None, common + ["micro_batch_size=4", f"output_dir={tmp_path / 'one'}"]))
    logged = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged] == pytest.approx([h["loss"] for h in one["history"]], rel=1e-5)
    assert sum("checkpoint: " in log for log in logs) == 1  # (the node of rank 0 reports)
    assert [p.name for p in (tmp_path / "two").glob("checkpoint-*")] == ["checkpoint-3"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_rank_that_dies_on_two_gpus_over_nccl_ends_the_job(tmp_path):
    """Rank 1 os._exit(9)s mid-backward of step 2 over NCCL. Gloo's peer raises at once (exit 7); NCCL's
    collectives only enqueue, so rank 0 blocks at its next host sync: what ends it (its watchdog, 6; the
    NCCL watchdog's abort; or RankLost, 7) and how fast is what this records. Nothing is left running."""
    import time

    t0 = time.monotonic()
    procs, texts = faulty_job(tmp_path, "die", ["progress=false", "device=cuda", "max_steps=4", "micro_batch_size=2",
                                                "watchdog_seconds=60", f"output_dir={tmp_path / 'o'}"], timeout=140)
    took = time.monotonic() - t0
    for p in procs:  # (a survivor left behind would hold its GPU for the rest of the call)
        if p.is_alive():
            p.kill()
            p.join()
    print(f"\nnccl die: exit codes {[p.exitcode for p in procs]} after {took:.0f} s; rank 0's last lines:\n"
          + "\n".join(texts[0].splitlines()[-4:]))
    assert procs[1].exitcode == 9
    assert took < 150 and procs[0].exitcode != 0, texts[0][-2000:]


def _trainer_parity(tmp_path, device: str, rel: float) -> None:
    """`slideformer train` on 2 ranks against one process with the global batch, then resumed (auto) by the
    2 ranks: from_leader, the checkpoint's object collectives, evaluation and the stop vote all run."""
    from slideformer.train.config import load_config
    from slideformer.train.loop import train

    common = ["progress=false", f"device={device}", "bf16=false", "logging_steps=1", "save_steps=2",
              "gradient_accumulation_steps=2", "max_grad_norm=1.0", "val_size=0.1", "watchdog_seconds=120"]
    solo = common + ["micro_batch_size=4", f"output_dir={tmp_path / 'one'}"]
    ref = [h["loss"] for h in train(load_config(None, solo + ["max_steps=4"]))["history"]]
    one = train(load_config(None, solo + ["max_steps=6", "resume_from_checkpoint=auto"]))
    ref += [h["loss"] for h in one["history"]]
    first = two_trainers(tmp_path, common + ["max_steps=4", "micro_batch_size=2"])
    rest = two_trainers(tmp_path, common + ["max_steps=6", "micro_batch_size=2", "resume_from_checkpoint=auto"])
    for a, b in zip(first, rest):
        assert a["losses"] + b["losses"] == pytest.approx(ref, rel=rel)
        assert b["evals"][-1]["eval_loss"] == pytest.approx(one["evals"][-1]["eval_loss"], rel=rel)
    assert "checkpoint-6" in [p.name for p in (tmp_path / "two").glob("checkpoint-*")]


def test_the_trainer_resumes_under_torchrun_as_one_process(tmp_path):
    _trainer_parity(tmp_path, "cpu", 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_the_trainer_on_two_gpus_over_nccl_trains_and_resumes_as_one_process(tmp_path):
    _trainer_parity(tmp_path, "cuda", 1e-4)
