"""The benchmark harness runs end to end (on the CPU, tiny model), so it cannot rot between GPU runs."""
import pytest

from slideformer.bench import harness


@pytest.mark.parametrize("system", ["slideformer", "plain"])
def test_harness_cpu_smoke(system, tmp_path):
    out = tmp_path / "r.jsonl"
    rec = harness.main(["--system", system, "--model", "tiny", "--device", "cpu", "--seq", "32", "--batch", "2",
                        "--warmup", "1", "--steps", "2", "--out", str(out)])
    assert rec["tokens_per_s"] > 0 and rec["params"] > 0 and out.read_text().count("\n") == 1
    if system == "slideformer":
        assert set(rec["host_bytes"]) >= {"host_master", "host_moments", "host_grads"}


def test_timeline_lists_the_updates_of_the_timed_steps():
    """The window opens between steps of the running pipeline: it may hold the last warm-up step's final
    updates and leave out the last timed step's (the drain), never a whole step more."""
    rec = harness.main(["--system", "slideformer", "--model", "tiny", "--device", "cpu", "--seq", "32", "--batch", "2",
                        "--warmup", "1", "--steps", "2", "--timeline"])
    host = rec["timeline"]["host"]
    units = 4 + 2  # the tiny model's 4 layers, its embedding and its head
    assert {k for k, *_ in host} == {"optimizer"} and len(host) >= units
    assert sorted({u for _, u, _, _ in host}) == list(range(units))
    # nothing after the timed steps: the spans fit in their time (the drain after them is left out)
    assert max(e for *_, e in host) <= 1e3 * 2 * rec["step_s"] + 50
    assert all(0 <= s <= e for _, _, s, e in host) and host[0][2] == 0.0
    assert "timeline" not in rec["breakdown_per_step_s"]


def test_offload_activations_flag_moves_layer_inputs_to_the_host():
    args = ["--system", "slideformer", "--model", "tiny", "--device", "cpu", "--seq", "32", "--batch", "2",
            "--warmup", "1", "--steps", "1"]
    kept = harness.main(args)
    off = harness.main(args + ["--offload-activations", "1"])  # the tiny model's 4 layers: 3 offloaded
    assert kept["host_bytes"]["host_activations"] == 0 and kept["settings"]["offload_activations"] is None
    assert off["host_bytes"]["host_activations"] == 3 * 2 * 32 * 128 * 4 and off["settings"]["offload_activations"] == 1


def test_harness_with_a_gpu_budget_records_the_placement(tmp_path):
    rec = harness.main(["--system", "slideformer", "--model", "tiny", "--device", "cpu", "--seq", "32", "--batch", "4",
                        "--warmup", "1", "--steps", "1", "--gpu-memory-limit-gib", "0.05"])
    (p,) = rec["placement"].values()
    assert p["micro_batch"] <= 4 and rec["settings"]["gpu_memory_limit_gib"] == 0.05
    # what was asked, and what auto chose (the tiny model's state is far under any RAM: all of it)
    assert rec["settings"]["host_grad_buffers"] == rec["settings"]["host_weights"] == "auto"
    assert rec["host_grad_buffers_chosen"] is None and rec["host_weights_chosen"] == "persistent"


def test_report_table_and_plot(tmp_path):
    import json

    from slideformer.bench import report

    rows = [
        {"system": "slideformer", "model": "m", "seq": 8, "batch": 2, "tokens_per_s": 300.0, "gpu_peak_alloc_gib": 1.0,
         "host_peak_rss_gib": 2.0, "settings": {"slots": 2}},
        {"system": "slideformer", "model": "m", "seq": 8, "batch": 2, "tokens_per_s": 200.0, "gpu_peak_alloc_gib": 1.0,
         "host_peak_rss_gib": 2.0, "settings": {"slots": 3}},
        {"system": "plain", "model": "m", "seq": 8, "batch": 2, "tokens_per_s": 100.0, "gpu_peak_alloc_gib": 3.0,
         "host_peak_rss_gib": 1.0, "settings": {}},
        {"system": "slideformer", "model": "m", "seq": 8, "batch": 2, "tokens_per_s": 90.0, "gpu_peak_alloc_gib": 1.0,
         "host_peak_rss_gib": 2.0, "settings": {"gpu_memory_limit_gib": 1, "host_grad_buffers": "auto"},
         "host_grad_buffers_chosen": None},
        # asked for explicitly in a file that records the ask: its own column, not the default's
        {"system": "slideformer", "model": "m", "seq": 8, "batch": 2, "tokens_per_s": 80.0, "gpu_peak_alloc_gib": 1.0,
         "host_peak_rss_gib": 2.0, "settings": {"gpu_memory_limit_gib": 1, "host_grad_buffers": 4},
         "host_grad_buffers_chosen": 4},
    ]
    base = {"model": "m", "seq": 8, "gpu_peak_alloc_gib": 1.0, "host_peak_rss_gib": 2.0}
    rows += [
        # a file from before session 5 records host_weights resolved, without *_chosen keys: still a variant
        {**base, "system": "slideformer", "batch": 4, "tokens_per_s": 70.0, "settings": {"host_weights": "staged"}},
        # depth: 1 was the default until a36f3eb, unset since; from 7174db3 (files with optimizer_threads)
        # 1 is asked for, a variant, as are the optimizer's threads
        {**base, "system": "slideformer", "batch": 4, "tokens_per_s": 60.0,
         "settings": {"depth": None, "optimizer_threads": None}},
        {**base, "system": "slideformer", "batch": 16, "tokens_per_s": 20.0, "settings": {"depth": None}},
        {**base, "system": "slideformer", "batch": 4, "tokens_per_s": 50.0,
         "settings": {"depth": 2, "optimizer_threads": None}},
        {**base, "system": "slideformer", "batch": 4, "tokens_per_s": 40.0,
         "settings": {"depth": 1, "optimizer_threads": 14}},
        {**base, "system": "slideformer", "batch": 8, "tokens_per_s": 30.0, "settings": {"depth": 1}},
        # a baseline that ran out of GPU memory: its cell says so, and no ratio is taken against it
        {**base, "system": "deepspeed", "batch": 4, "tokens_per_s": None, "error": "out of GPU memory", "settings": {}},
    ]
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = report.table(report.load([f]))
    assert "slideformer (host_weights=staged)" in md and "slideformer (depth=2)" in md
    assert "slideformer (depth=1, optimizer_threads=14)" in md
    head = md.splitlines()[0].split("|")
    b8 = next(line for line in md.splitlines() if line.startswith("| m | 8 | 8 |")).split("|")
    assert b8[head.index(" slideformer tok/s (GPU / host GiB) ")].strip() == "30 (1.0 / 2)"  # an old file's default
    b16 = next(line for line in md.splitlines() if line.startswith("| m | 8 | 16 |")).split("|")
    assert b16[head.index(" slideformer tok/s (GPU / host GiB) ")].strip() == "20 (1.0 / 2)"  # table21's default
    assert "depth=None" not in md
    b4 = next(line for line in md.splitlines() if line.startswith("| m | 8 | 4 |"))
    assert "| 60 (1.0 / 2) |" in b4 and "| out of GPU memory |" in b4 and "x" not in b4.split("out of GPU memory")[1]
    assert "slideformer (slots=2)" in md and "| 2.000x |" in md  # the default variant against plain
    # under a cap plain has no line: the ratio is against plain on the whole card, marked
    assert "| 0.900x* |" in md and "against plain training on the whole card" in md
    assert "slideformer (host_grad_buffers=4)" in md and "| 80 (1.0 / 2) |" in md
    report.plot(report.load([f]), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    # a case run again (an A/B of two commits on one machine): every run its row, named by its commit
    ab = tmp_path / "ab.jsonl"
    ab.write_text("".join(json.dumps({**base, "system": "slideformer", "batch": 8, "tokens_per_s": t, "commit": c,
                                      "settings": {}}) + "\n" for t, c in ((11, "aaa"), (12, "bbb"), (13, "aaa"))))
    md = report.table(report.load([ab]))
    assert [line.split("|")[1].strip() for line in md.splitlines()[2:]] == ["m @aaa", "m @aaa", "m @bbb"]
    assert all(f"| {t} (1.0 / 2) |" in md for t in (11, 12, 13))


def test_out_of_gpu_memory_is_recorded_as_a_result(tmp_path, monkeypatch):
    """A baseline that does not fit under the cap leaves a line saying so (then fails, as before)."""
    import json

    import torch

    def no_room(args, config):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.19 GiB")

    monkeypatch.setitem(harness.RUNNERS, "deepspeed", no_room)
    out = tmp_path / "r.jsonl"
    with pytest.raises(torch.OutOfMemoryError):
        harness.main(["--system", "deepspeed", "--model", "tiny", "--device", "cpu", "--batch", "64", "--out", str(out)])
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["error"] == "out of GPU memory" and "1.19 GiB" in rec["detail"]
    assert rec["batch"] == 64 and rec["system"] == "deepspeed" and "tokens_per_s" not in rec and rec["commit"]
    # every line says where it ran and how to run it again
    assert rec["command"].startswith("slideformer bench --system deepspeed --model tiny") and "--batch 64" in rec["command"]
    assert rec["machine"]["cores"] >= 1 and rec["machine"]["ram_gib"] > 0 and "cpu" in rec["machine"]

    def no_pinned_ram(args, config):
        raise RuntimeError("CUDA error: out of memory")  # what a failed pinned host allocation raises

    def a_bug(args, config):
        raise RuntimeError("shape mismatch")

    for runner in (no_pinned_ram, a_bug):
        monkeypatch.setitem(harness.RUNNERS, "deepspeed", runner)
        with pytest.raises(RuntimeError):
            harness.main(["--system", "deepspeed", "--model", "tiny", "--device", "cpu", "--out", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["error"] for r in lines] == ["out of GPU memory", "out of host memory"]  # a bug is no result



def test_a_killed_case_is_recorded_without_running_it(tmp_path, monkeypatch):
    """run_device.sh writes the line a case killed by the host (out of RAM) could not: the report shows it."""
    import json

    from slideformer.bench import report

    monkeypatch.setitem(harness.RUNNERS, "deepspeed", lambda args, config: pytest.fail("ran"))
    out = tmp_path / "r.jsonl"
    harness.main(["--system", "deepspeed", "--model", "tiny", "--device", "cpu", "--gpu-memory-limit-gib", "24",
                  "--failed", "killed by the host (SIGKILL)", "--out", str(out)])
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["error"] == "killed by the host (SIGKILL)" and rec["host_peak_rss_gib"] is None
    assert rec["settings"]["gpu_memory_limit_gib"] == 24 and "tokens_per_s" not in rec
    assert "| killed by the host (SIGKILL) |" in report.table(report.load([out]))

def test_optimizer_benchmark_reports_every_candidate():
    import torch

    from slideformer.bench import optimizer

    rec = optimizer.main(["--params", "200000", "--threads", "1,2", "--rounds", "1"])
    for key in ("stream_copy_gbs", "native_t1_gparams", "native_t2_gparams", "chunked_t1_gparams",
                "compact_t2_gparams", "out_of_place_t2_gparams", "torch_fused_t2_gparams", "native_vs_torch_fused"):
        assert rec[key] > 0, key
    # issue 4's 4B parameters fit the host only with the other candidates' buffers left out
    lean = optimizer.main(["--params", "200000", "--threads", "2", "--rounds", "1", "--only", "native,torch_fused"])
    assert lean["native_vs_torch_fused"] > 0 and lean["only"] == ["native", "torch_fused"]
    assert not any(k.startswith(("compact", "out_of_place")) for k in lean)
    with pytest.raises(SystemExit):
        optimizer.main(["--params", "1000", "--only", "compact,bogus"])
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():  # (the copies' candidate is a GPU test's)
        assert "no CUDA" in optimizer.main(["--params", "1000", "--threads", "1", "--only", "dma"])["dma"]
    optimizer.main(["--params", "1000", "--threads", "1", "--rounds", "1", "--only", "native"])
    assert torch.get_num_threads() == threads  # (given back: the rest of a suite ran on one thread, otherwise)


@pytest.mark.gpu
def test_optimizer_benchmark_updates_under_copies():
    from slideformer.bench import optimizer

    rec = optimizer.main(["--params", "4000000", "--threads", "2", "--rounds", "1", "--only", "dma"])
    assert rec["dma_copies_gbs"] > 1 and rec["native_dma_t1_gparams"] > 0 and rec["dma_vs_alone"] > 0


def test_convergence_run_compares_the_state_formats():
    """The fine-tuning run end to end on a sliver of its corpora: every format's arm, and FP8's, starts from
    the same pretrained weights, improves on the held-out documentation, and stays close to fp32's after a
    few steps (FP8's not equal to it)."""
    from slideformer.bench import convergence

    s = convergence.main(["--pretrain-steps", "6", "--steps", "4", "--eval-every", "2", "--seeds", "0",
                          "--limit-chars", "60000", "--seq", "64", "--batch", "4", "--states", "fp32,compact,8bit,fp8"])
    for state in ("fp32", "compact", "8bit", "fp8"):
        (final,) = s[f"final_eval_{state}"]
        assert final < s["pretrained_eval_loss"], state
    assert s["max_abs_diff_compact"] < 0.01 and s["max_abs_diff_8bit"] < 0.01 and 0 < s["max_abs_diff_fp8"] < 0.01


def test_profile_names_the_shapes_of_each_matrix_product():
    """The kernel table says which GEMM kernel is slow; the matmul table says which product launched it."""
    import torch

    a, b, c = torch.randn(64, 32), torch.randn(32, 16), torch.randn(16, 8)
    out = harness.profile_ops(lambda: (a @ b) @ c, lambda: None, 5)
    shapes = sorted(r["shapes"] for r in out["matmuls"])
    assert shapes == [[[64, 16], [16, 8]], [[64, 32], [32, 16]]]
    assert all(r["op"] == "aten::mm" and r["calls"] == 1 for r in out["matmuls"])


def test_kernel_launchers_name_the_aten_op_and_its_callers():
    """A kernel is filed under the innermost aten op above its launch (with operand shapes) and two callers."""
    from types import SimpleNamespace as E

    lin = E(name="aten::linear", input_shapes=[], cpu_parent=E(name="MyLayer", input_shapes=[], cpu_parent=None))
    mm = E(name="aten::mm", input_shapes=[[8, 4], [4, 2]], cpu_parent=lin)
    launch = E(name="cudaLaunchKernel", input_shapes=[], cpu_parent=mm,
               kernels=[E(name="gemm", duration=2000.0), E(name="other", duration=5.0)])
    # the op holds its runtime call's kernel too: counted once, at the call
    mm.cpu_children, mm.kernels = [launch], [E(name="gemm", duration=2000.0)]
    prof = E(events=lambda: [launch, launch, mm])
    out = harness.kernel_launchers(prof, {"gemm"})
    assert out == {"gemm": [["aten::mm [[8, 4], [4, 2]] < aten::linear < MyLayer", 2, 0.004]]}


@pytest.mark.parametrize("tied", [True, False])
def test_baselines_step_gives_the_gradients_of_hf_own_loss(tied):
    """plain's and torchao's step (slideformer's loss head beside HF's body, one backward) trains the same
    model as ``model(ids, labels=ids).loss.backward()``: a tied weight gets its head and embedding parts."""
    import argparse

    import torch
    from transformers import AutoModelForCausalLM

    from slideformer.presets import preset_config

    config = preset_config("tiny")
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    args = argparse.Namespace(batch=2, seq=16, device="cpu", dtype=torch.float32, loss_kernel="torch", loss_chunk=8)
    loss = harness._head_step(args, config, model, torch.Generator().manual_seed(0))
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ids = harness.random_batch(config.vocab_size, 2, 16, torch.Generator().manual_seed(0))["input_ids"]
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_torchao_needs_a_gpu():
    with pytest.raises(SystemExit, match="CUDA"):
        harness.main(["--system", "torchao", "--model", "tiny", "--device", "cpu"])


def test_every_named_benchmark_case_is_a_valid_case():
    """bench/cases.yaml is data the device runner expands: each case names a system, a preset and a batch,
    and its flags parse as the harness's."""
    from pathlib import Path

    import yaml

    from slideformer.bench.harness import RUNNERS, parser
    from slideformer.presets import PRESETS

    cases = yaml.safe_load((Path(__file__).parents[1] / "bench" / "cases.yaml").read_text())
    assert "default" in cases and len(cases) > 30
    for name, entry in cases.items():
        assert entry["cases"], name
        for case in entry["cases"]:
            system, model, batch, *flags = case.split()
            assert system in RUNNERS and model in PRESETS and int(batch) > 0, (name, case)
            parser().parse_args(["--system", system, "--model", model, "--batch", batch, *flags])


def test_the_competitors_baselines_load_from_the_repository():
    """DeepSpeed's and torchao's runners are not in the installed package; the harness finds them in the
    checkout's bench/baselines.py (their own imports happen only when they run)."""
    from slideformer.bench import harness

    assert harness.BASELINES.is_file()
    assert callable(harness.runner("deepspeed")) and callable(harness.runner("torchao"))
    assert not hasattr(harness, "run_deepspeed") and not hasattr(harness, "run_torchao")


def test_plan_on_prints_the_plan_the_benchmark_would_train_with_and_runs_nothing(capsys):
    """--plan-on resolves a case as the benchmark does, for a machine's GPU and RAM given on a machine
    without them (bench/compare_plans.sh): Qwen3-4B b32 under the reference's 9.5 / 58 GiB footprint takes
    micro-batches of 16 sequences; Llama-3.1-8B b32 under 11.5 / 103 GiB keeps 8, whose plan leaves the
    embedding its bf16 host copy."""
    import json

    rec = harness.main(["--system", "slideformer", "--model", "qwen3-4b", "--batch", "32", "--gpu-memory-limit-gib",
                        "9.5", "--host-memory-limit-gib", "58", "--plan-on", "139.8,125.8"])
    assert json.loads(capsys.readouterr().out) == rec
    assert rec["micro_batch"] == 16 and rec["problem"] is None and rec["micro_batch_tokens"] is None
    rec = harness.main(["--system", "slideformer", "--model", "llama3-8b", "--batch", "32", "--gpu-memory-limit-gib",
                        "11.5", "--host-memory-limit-gib", "103", "--plan-on", "139.8,125.8"])
    assert rec["micro_batch"] == 8 and rec["micro_batch_tokens"] == 8192 and rec["host_weights"] != "staged"
    with pytest.raises(SystemExit, match="slideformer's cases only"):
        harness.main(["--system", "plain", "--model", "qwen3-4b", "--plan-on", "139.8,125.8"])


def test_the_timeline_names_where_memory_peaks_and_where_the_gpu_waits(tmp_path):
    """bench/timeline.py reads a --timeline record: the peak's visit by unit and pass (a unit's visits
    alternate forward and backward; the head is one), the planner's categories for the same case, and the
    GPU's idle and weight waits by part of the step (two steps here), the largest named."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("timeline", Path(__file__).parents[1] / "bench" / "timeline.py")
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    # a tiny model's step: embedding, 4 layers, head, 4 layers back, embedding; the peak rises last at layer 2's backward
    units = [0, 1, 2, 3, 4, 5, 4, 3, 2, 1, 0]
    peaks = [10, 20, 30, 40, 50, 70, 80, 80, 90, 90, 90]
    rows = [[u, 0.0, 0.0, 0.0, p] for u, p in zip(units, peaks)]
    assert mp.peak_visit(rows, 4) == (8, "layer 1, backward")
    rows[5][4], rows[6][4] = 90, 90
    assert mp.peak_visit(rows[:6], 4) == (5, "the loss head")
    rec = {"command": "slideformer bench --system slideformer --model tiny --batch 4 --gpu-memory-limit-gib 1 "
                      "--timeline --out x.jsonl", "machine": {"ram_gib": 64.0, "gpu_gib": 80.0}}
    plan = mp.planned(rec)
    assert {"window", "loss_head", "layer_backward", "peak before SAFETY"} <= set(plan)
    assert 0 < plan["peak before SAFETY"] < 1
    # [unit, start, ready, end] in ms: step 2 starts 6 ms after step 1's last visit, and waits 2 ms for the
    # embedding's weights; layer 1's backward in step 1 waits 1 ms for its weights, 0.5 idle before it
    t, rows = 0.0, []
    for gap, wait in [(0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0, 0), (0.5, 1), (0, 0), (0, 0)] + \
            [(6, 2)] + [(0, 0)] * 10:
        start = t + gap
        rows.append([units[len(rows) % 11], start, start + wait, start + wait + 1.0, 0])
        t = start + wait + 1.0
    sums, top = mp.waits(rows, 4)
    assert sums == {"idle start": 6.0, "weights start": 2.0, "idle backward": 0.5, "weights backward": 1.0}
    start = rows[11][1]  # (the resident units' AdamW on the GPU in 4 of those 6 ms: not idle)
    assert mp.waits(rows, 4, busy=[[start - 5, start - 1]])[0]["idle start"] == 2.0
    assert top[0] == (6.0, "idle", 11, "the embedding, forward") and top[-1][1:] == ("idle", 8, "layer 1, backward")
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({**rec, "commit": "abc", "model": "tiny", "gpu_peak_reserved_gib": 0.5,
                                "timeline": {"gpu": rows}}) + "\n")
    waited, memory = mp.report(str(path))
    assert "over 2 step(s)" in waited and "idle start 6.0" in waited and "weights backward 1.0" in waited
    assert "reached at visit 0 (the embedding, forward)" in memory and "planned GiB" in memory


def test_allocation_retries_are_named_with_what_they_waited_for():
    """A retry in torch's memory history (bench/allocations.py): the frees completed just before the unmaps
    are the blocks that waited for another stream, the next allocation is the one that hit the cap."""
    from slideformer.bench.allocations import retries

    MiB = 2**20
    here = [{"filename": "/x/torch/cuda/memory.py", "line": 1, "name": "inner"},
            {"filename": "/x/slideformer/model/fused_ops.py", "line": 62, "name": "_swiglu_forward"}]

    def ev(action, t_ms, addr=0, size=0, frames=()):
        return {"action": action, "time_us": 1_000_000 + int(t_ms * 1000), "addr": addr, "size": size,
                "frames": list(frames)}
    trace = [ev("segment_map", 0, 0, 1000 * MiB), ev("alloc", 1, 1, 80 * MiB), ev("alloc", 2, 2, 80 * MiB),
             ev("alloc", 3, 3, 300 * MiB), ev("free_requested", 5, 1, 80 * MiB),
             ev("free_requested", 9, 2, 80 * MiB), ev("free_completed", 10, 3, 300 * MiB),  # (not in the retry)
             ev("alloc", 11, 4, 100 * MiB),
             ev("free_completed", 205, 1, 80 * MiB), ev("free_completed", 205, 2, 80 * MiB),
             ev("segment_unmap", 206, 0, 400 * MiB), ev("segment_unmap", 207, 500, 300 * MiB),
             ev("segment_map", 208, 0, 304 * MiB), ev("alloc", 208, 5, 304 * MiB, here)]
    (r,) = retries(trace)
    assert r["at_ms"] == 206.0 and r["size_mib"] == 304.0 and r["where"] == ["fused_ops.py:62 _swiglu_forward"]
    assert r["freed_blocks"] == 2 and r["freed_waited_ms"] == [196.0, 200.0]
    assert r["allocated_gib"] == round(100 * MiB / 2**30, 2) and r["mapped_gib"] == round(1000 * MiB / 2**30, 2)
    assert r["unmapped_gib"] == round(700 * MiB / 2**30, 2)
    assert retries(trace[:8]) == []


def test_memory_history_needs_a_gpu(tmp_path):
    from slideformer.bench.harness import main

    with pytest.raises(SystemExit, match="run it on a GPU"):
        main(["--system", "slideformer", "--model", "tiny", "--device", "cpu",
              "--memory-history", str(tmp_path / "h.pkl.gz")])
    kept = tmp_path / "kept"
    kept.write_text("the user's")
    with pytest.raises(SystemExit, match="exists; name a new file"):
        main(["--system", "slideformer", "--model", "tiny", "--device", "cpu", "--memory-history", str(kept)])
    assert kept.read_text() == "the user's"
