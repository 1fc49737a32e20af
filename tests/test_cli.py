"""`slideformer train` with no arguments is the demo: it must train and export a loadable model."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slideformer.config import Placement
from slideformer.cli import main
from slideformer.train.config import _assets


def test_train_demo_exports_a_transformers_model(tmp_path):
    out = tmp_path / "demo"
    assert main(["train", "max_steps=40", "device=cpu", "progress=false", f"output_dir={out}"]) == 0
    out = out / "checkpoint-40"
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("### Instruction:\nWhat is 2 plus 2?\n### Response:\n", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]
    assert torch.isfinite(model(ids).logits).all()


def test_plan_json_and_exit_codes(capsys):
    import json

    code = main(["plan", "--model", "llama3-8b", "--seq-len", "1024", "--batch-size", "64", "--gpu-memory", "24GiB",
                 "--cpu-memory", "125GiB", "--host-weights", "staged", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["fits"] and out["max_batch_size"] >= 64
    assert {"gpu_bytes", "host_bytes", "nvme_bytes", "fits", "max_batch_size"} <= set(out)
    assert out["gpu_bytes"] <= 24 * 2**30
    code = main(["plan", "--model", "llama3-8b", "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "4GiB",
                 "--cpu-memory", "125GiB"])
    assert code == 3 and "does NOT fit" in capsys.readouterr().out
    # 14B does not fit in 125 GiB of RAM; with its moments on NVMe it does
    base = ["plan", "--model", "qwen2.5-14b", "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "24GiB",
            "--cpu-memory", "125GiB", "--host-weights", "staged", "--json"]
    assert main(base) == 3
    capsys.readouterr()
    assert main(base + ["--offload-dir", "/nvme"]) == 0  # (nvme_fraction auto: as few layers as RAM needs)
    least = json.loads(capsys.readouterr().out)
    assert main(base + ["--offload-dir", "/nvme", "--nvme-fraction", "1"]) == 0  # every layer's moments
    out = json.loads(capsys.readouterr().out)
    assert 0 < least["nvme_bytes"] < out["nvme_bytes"] and least["host_bytes"] > out["host_bytes"]
    assert out["nvme_bytes"] > 90 * 2**30 and out["host_bytes"] < 125 * 2**30
    # the tier's disk traffic (moments read and written once a step, at once: the writes at ~0.96 GB/s bound
    # it) dominates the predicted step
    assert out["timing"]["nvme_s"] == pytest.approx(out["nvme_bytes"] / 0.96e9)
    assert out["predicted_step_s"] >= out["timing"]["nvme_s"]
    assert main(base + ["--offload-dir", "/nvme", "--nvme-fraction", "1", "--optimizer-state", "compact"]) == 0
    compact = json.loads(capsys.readouterr().out)
    assert compact["nvme_bytes"] == out["nvme_bytes"] // 2  # bf16 moments on the tier
    assert main(base[:-3] + ["--json", "--offload-dir", "/nvme", "--nvme-fraction", "1", "--nvme-master"]) == 0
    tier_master = json.loads(capsys.readouterr().out)
    assert tier_master["nvme_bytes"] == out["nvme_bytes"] * 3 // 2  # the fp32 master joins the moments
    assert tier_master["host"]["master"] < out["host"]["master"]


def test_plan_counts_the_ram_resident_units_free(capsys):
    """Resident units keep no host state, so where RAM cannot hold every layer's streamed, it may still hold
    what `train` would stream beside its resident units: plan says so, and its largest batch agrees. (RAM holds
    it as train checks it: the state within 95% of the RAM.)"""
    import json

    base = ["plan", "--model", "qwen3-4b", "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "24GiB", "--json"]
    assert main(base + ["--cpu-memory", "42GiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_bytes"] > 42 * 2**30 and out["host_bytes_resident"] <= 0.95 * 42 * 2**30  # (the first: streamed)
    assert out["fits"] and out["max_batch_size"] >= 8
    assert main(base + ["--cpu-memory", "30GiB"]) == 3
    out = json.loads(capsys.readouterr().out)
    assert not out["fits"] and out["max_batch_size"] == 0


def test_plans_largest_batch_is_counted_up_from_one(capsys):
    """Plan names the largest batch below which every batch fits, counted up from one: whether a plan fits
    need not grow with the batch (its micro-batches divide it, so a prime batch has only one row or all of
    them), so the first batch that does not fit is what is said, never one past a gap."""
    import json

    def plan(b: int) -> dict:
        main(["plan", "--model", "qwen3-4b", "--seq-len", "1024", "--batch-size", str(b), "--json",
              "--gpu-memory", "24GiB", "--cpu-memory", "42GiB"])
        return json.loads(capsys.readouterr().out)

    first = plan(1)
    best = first["max_batch_size"]
    assert 8 <= best < 4096
    assert all(plan(b)["fits"] for b in range(2, best + 1)) and first["fits"]
    assert not plan(best + 1)["fits"]


def test_export_drops_the_training_state(tmp_path):
    assert main(["train", "max_steps=2", "device=cpu", "progress=false", f"output_dir={tmp_path / 'o'}"]) == 0
    assert main(["export", str(tmp_path / "o" / "checkpoint-2"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (tmp_path / "hf" / "state").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf") is not None
    # (not into another checkpoint, even with --overwrite: its weights would no longer match its state)
    assert main(["train", "max_steps=3", "save_steps=1", "save_total_limit=null", "device=cpu", "progress=false",
                 f"output_dir={tmp_path / 'o'}"]) == 0
    before = (tmp_path / "o" / "checkpoint-2" / "model.safetensors").read_bytes()
    assert main(["export", str(tmp_path / "o" / "checkpoint-3"), str(tmp_path / "o" / "checkpoint-2"),
                 "--overwrite"]) == 2
    assert (tmp_path / "o" / "checkpoint-2" / "model.safetensors").read_bytes() == before


def test_plan_suggests_what_train_would_choose(capsys):
    """`plan` takes the trainer's engine settings: compact state's resident layers (10 GPU bytes a
    parameter, not 16) and a bf16 host copy decided per batch."""
    import json

    from slideformer import EngineConfig
    from slideformer.plan import ModelShape, auto_residency
    from slideformer.presets import preset_config
    from slideformer.model import ModelAdapter

    args = ["plan", "--model", "qwen3-4b", "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "24GiB",
            "--cpu-memory", "125GiB", "--json"]
    outs = {}
    for state in ("fp32", "compact"):
        assert main(args + ["--optimizer-state", state]) == 0
        outs[state] = json.loads(capsys.readouterr().out)
        # (speculative_layers "auto": train passes every layer for the residency choice)
        cfg = EngineConfig(device="cpu", gpu_memory_limit="24GiB", optimizer_state=state, max_grad_norm=1.0, placement=Placement(speculative_layers=36))
        chosen = auto_residency(cfg, ModelShape.from_adapter(ModelAdapter(preset_config("qwen3-4b"))), 8, 1024)
        assert outs[state]["suggested_resident_layers"] == chosen["resident_layers"]
    assert outs["compact"]["suggested_resident_layers"] > outs["fp32"]["suggested_resident_layers"]
    assert outs["fp32"]["host_weights"] == "persistent"
    # bound by the CPU update at b8, fp32 state gets compact state's prediction (as compact plans it itself)
    assert outs["fp32"]["predicted_step_s_compact"] == outs["compact"]["predicted_step_s_resident"] \
        < outs["fp32"]["predicted_step_s_resident"]
    assert outs["fp32"]["host_bytes_compact"] < 0.7 * outs["fp32"]["host_bytes"]  # 8 instead of 14 bytes/param
    # resident units keep no host state: with the suggested ones the RAM holds less than with none
    assert outs["fp32"]["host_bytes_resident"] < outs["fp32"]["host_bytes"]
    assert outs["compact"]["host_bytes_resident"] == outs["fp32"]["host_bytes_compact"]
    assert "predicted_step_s_compact" not in outs["compact"]
    # clipping (the trainer's default): with a spare state for every streamed layer the updates run before
    # the norm as they would unclipped; where RAM has no room for spares they wait for backward: slower
    assert outs["fp32"]["clipping"] and outs["fp32"]["speculative_layers"] == 36
    assert outs["fp32"]["predicted_step_s_resident_unclipped"] == outs["fp32"]["predicted_step_s_resident"]
    assert main(args[:-2] + ["60GiB", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert short["speculative_layers"] == 0 and short["fits"]  # (60 GiB: room for none)
    assert short["predicted_step_s_resident_unclipped"] < 0.85 * short["predicted_step_s_resident"]
    # GPU-bound at b64: nothing to suggest
    assert main(args[:6] + ["64"] + args[7:]) == 0
    assert "predicted_step_s_compact" not in json.loads(capsys.readouterr().out)


def test_version_and_help_start_without_torch(capsys):
    import subprocess
    import sys

    from slideformer import EngineConfig, __version__
    from slideformer.cli import PLAN_DEFAULTS

    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"slideformer {__version__}"
    code = ("import sys\nfrom slideformer.cli import main\ntry:\n    main(['train', '--help'])\nexcept SystemExit:\n"
            "    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
    assert out.strip().endswith("False") and "Exit codes" in out
    assert PLAN_DEFAULTS == {k: getattr(EngineConfig, k) for k in PLAN_DEFAULTS}


def test_the_cli_asks_for_expandable_segments_unless_the_user_chose():
    """Before CUDA starts: fixed segments would keep gaps reserved over the budget the planner kept
    allocations under (the benchmarks' reserved figures are with expandable segments)."""
    import os
    import subprocess
    import sys

    code = ("import os\nfrom slideformer.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n"
            "    pass\nprint(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    assert out.strip().endswith("expandable_segments:True")
    env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:64"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    assert out.strip().endswith("max_split_size_mb:64")
    env.pop("PYTORCH_CUDA_ALLOC_CONF")
    env["PYTORCH_ALLOC_CONF"] = "max_split_size_mb:64"  # (torch's newer name)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    assert out.strip().endswith("None")


def test_logs_are_plain_lines_off_a_terminal_and_name_no_gpu_on_the_cpu(tmp_path, capsys):
    """stdout a file or pipe (here: captured): no redrawn bar, whole lines; a CPU run shows no GPU memory."""
    assert main(["train", "max_steps=2", "device=cpu", "progress=true", "logging_steps=1",
                 f"output_dir={tmp_path}"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    assert all("host" in line and "GPU" not in line and "0.0 TFLOPS" not in line for line in lines)


def test_plan_names_what_binds(capsys):
    args = ["plan", "--model", "llama3-8b", "--seq-len", "1024", "--batch-size", "64", "--gpu-memory", "24GiB"]
    assert main(args + ["--cpu-memory", "32GiB"]) == 3
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("does NOT fit host RAM") and "95% of 32.0 GiB, --cpu-memory" in last and "--offload-dir" in last
    assert main(["plan", "--model", "llama3-8b", "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "1GiB",
                 "--cpu-memory", "125GiB"]) == 3
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("does NOT fit the GPU")
    if not torch.cuda.is_available():
        main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1"])
        assert "no GPU here and no --gpu-memory" in capsys.readouterr().out
    # the tier already given is not suggested again; clipping's gradient per layer, where it is what binds, is
    import json

    big = ["plan", "--model", "llama3.1-70b", "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "24GiB",
           "--cpu-memory", "128GiB", "--offload-dir", "/nvme", "--optimizer-state", "8bit"]
    assert main(big) == 3
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "--offload-dir" not in last and "no clipping (--max-grad-norm 0" in last, last
    assert main(big + ["--json"]) == 3  # (the JSON says why too)
    assert json.loads(capsys.readouterr().out)["verdict"] == last.rsplit("; largest batch", 1)[0]


def test_plan_on_paper_for_another_machine(capsys):
    """Issue 21's plans on paper: a machine's rates as flags scale the time model's terms (GPU work, weight
    copies, the NVMe tier's traffic), and the largest presets plan. On a 24 GB card with 256 GB of RAM and an
    NVMe tier, Llama-3.1-70B fits with its fp32 master and moments on the tier (the planner puts the master
    there where the moments alone are not enough) and the bf16 copy in RAM, disk-bound; Mistral-Large-2's
    bf16 copy alone is over the RAM with fp32 state, so its tier layers are staged (their master read from
    disk), and with 8-bit state everything but buffers goes to the tier; Llama-3.1-405B's layer does not fit
    24 GB."""
    import json

    def plan(model, *extra):
        code = main(["plan", "--model", model, "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "24GB",
                     "--cpu-memory", "256GB", "--offload-dir", "/nvme", "--max-grad-norm", "0", "--json", *extra])
        return code, json.loads(capsys.readouterr().out)

    rtx = ("--gpu-tflops", "95", "--pcie-gbps", "25", "--disk-read-gbps", "7", "--disk-write-gbps", "6")
    code, base = plan("llama3.1-70b", *rtx)
    assert code == 0 and base["fits"] and 70e9 < base["params"] < 71e9
    assert base["host_bytes"] < 0.95 * 256e9 < base["nvme_bytes"]  # (the master on the tier too: 12 bytes a param)
    t = base["timing"]
    # (read and written once a step, the two directions sharing the faster one's 7 GB/s)
    assert t["nvme_s"] == pytest.approx(2 * base["nvme_bytes"] / 7e9) and base["predicted_step_s"] >= t["nvme_s"]
    _, slower = plan("llama3.1-70b", "--gpu-tflops", "47.5", "--pcie-gbps", "12.5", "--disk-read-gbps", "3.5",
                     "--disk-write-gbps", "3")
    for term in ("gpu_compute_s", "h2d_s", "nvme_s"):
        assert slower["timing"][term] == pytest.approx(2 * t[term], rel=1e-6), term
    # fp32 state: Mistral-Large-2's bf16 copy alone is over the RAM, so the tier layers are staged, the window
    # reading their fp32 master from disk (and casting it on the GPU)
    code, large = plan("mistral-large-2", *rtx)
    assert code == 0 and 122e9 < large["params"] < 123e9 and large["gpu_bytes"] <= 24e9
    assert large["host_bytes"] < 0.95 * 256e9 < 2 * large["params"] and isinstance(large["host_weights"], int)
    _, asked = plan("mistral-large-2", *rtx, "--nvme-master")  # (the master on the tier asked for: the same plan)
    assert asked["fits"] and asked["host_weights"] == large["host_weights"]
    _, hand = plan("llama3.1-70b", *rtx, "--host-weights", "staged")  # (staged asked for: the master goes too)
    assert hand["fits"] and hand["host"]["weights"] == 0  # (without nvme_master: 322 GiB, over the RAM)
    _, past = plan("llama3.1-70b", *rtx, "--host-weights", "1000")  # (more staged layers than it has: all, as train)
    _, every = plan("llama3.1-70b", *rtx, "--host-weights", "80")
    assert past["host_weights"] == 80 and past["host"] == every["host"]
    code, _ = plan("llama3.1-405b", *rtx)
    assert code == 3
    # 8-bit state: the tier takes the master too, and with it the weights the window reads, so RAM holds only
    # buffers and Mistral-Large-2 fits, bound by the disk (its weights read twice a step besides the state)
    code, large8 = plan("mistral-large-2", *rtx, "--optimizer-state", "8bit")
    assert code == 0 and large8["fits"] and large8["host_bytes"] < 0.95 * 256e9
    assert large8["nvme_bytes"] > 2 * 256e9  # (more than the RAM could hold: the master is on the tier too)
    t8 = large8["timing"]
    assert large8["predicted_step_s"] == pytest.approx(t8["nvme_s"] + t8["edge_stall_s"])
    assert t8["nvme_s"] == pytest.approx((2 + 4 / 6.06) * large8["nvme_bytes"] / 7e9, rel=0.02)
    _, given = plan("mistral-large-2", *rtx, "--optimizer-state", "8bit", "--disk-gbps", "13")  # (both at full rate)
    assert given["timing"]["nvme_s"] == pytest.approx((1 + 4 / 6.06) * large8["nvme_bytes"] / 7e9, rel=0.02)
    # fp32 state with the tier layers staged: the window reads their master from disk, so RAM holds no copy
    # of theirs, and the disk moves their fp32 master twice more a step
    code, staged = plan("llama3.1-70b", *rtx, "--nvme-master", "--host-weights", "staged", "--nvme-fraction", "1")
    assert code == 0 and staged["host"]["weights"] < 0.01 * base["host"]["weights"]  # (the edges' copy alone)
    tier = staged["nvme_bytes"]
    assert staged["timing"]["nvme_s"] == pytest.approx((2 * tier + 2 * 4 * tier / 12) / 7e9, rel=0.02)


def test_plan_names_a_disk_too_small_for_the_tier(capsys, tmp_path):
    """With the free disk known (--disk-space, or measured under an existing --offload-dir) a tier larger
    than it does not fit, and the line says how much it needs and has."""
    base = ["plan", "--model", "qwen2.5-14b", "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "24GiB",
            "--cpu-memory", "64GiB", "--offload-dir", str(tmp_path), "--optimizer-state", "compact", "--max-grad-norm",
            "0"]
    assert main(base + ["--disk-space", "10TB"]) == 0
    capsys.readouterr()
    assert main(base + ["--disk-space", "1GiB"]) == 3
    out = capsys.readouterr().out
    assert "does NOT fit the disk" in out and "1.0 GiB free there" in out and "(optimizer_state: 8bit)" in out
    assert main([a if a != "compact" else "8bit" for a in base] + ["--disk-space", "1GiB"]) == 3
    out = capsys.readouterr().out  # (the densest state says nothing of the state)
    assert "does NOT fit the disk" in out and "optimizer_state" not in out
    # RAM short too: the line names both (the RAM's fix alone would meet the disk's refusal next)
    assert main([a if a != "64GiB" else "16GiB" for a in base] + ["--disk-space", "1GiB"]) == 3
    out = capsys.readouterr().out
    assert "does NOT fit host RAM" in out and "and the NVMe tier needs about" in out and "1.0 GiB free there" in out


def test_plan_measures_the_free_disk_under_an_existing_offload_dir(capsys, tmp_path, monkeypatch):
    """Without --disk-space, plan asks the file system what is free under an existing --offload-dir."""
    import slideformer.machine

    seen = []
    monkeypatch.setattr(slideformer.machine, "disk_free", lambda path: seen.append(path) or 2**30)
    code = main(["plan", "--model", "qwen2.5-14b", "--seq-len", "1024", "--batch-size", "8", "--gpu-memory", "24GiB",
                 "--cpu-memory", "64GiB", "--offload-dir", str(tmp_path), "--max-grad-norm", "0", "--json"])
    import json

    out = json.loads(capsys.readouterr().out)
    assert code == 3 and seen == [str(tmp_path)] and out["binds"] in ("disk", "host") and not out["fits"]
    with pytest.raises(SystemExit) as usage:  # (argparse's error in one line, naming the help; exit 2)
        main(["plan", "--model", "tiny", "--seq-len", "64", "--batch-size", "1", "--gpu-tflops", "1e300"])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and "--gpu-tflops" in err and len(err.strip().splitlines()) == 1, err
    assert "slideformer plan --help" in err


def test_data_shows_what_training_sees(capsys, tmp_path):
    """`slideformer data`: the counts (samples, tokens, trained tokens, truncated, skipped, dropped) and samples
    with the trained tokens marked; a cutoff that truncates is counted; a missing file is one line, exit 2."""
    assert main(["data", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample") == 1 and "[[" in out and "]]" in out
    assert "samples 112 " in out and "truncated 0 " in out
    (tmp_path / "t.jsonl").write_text('{"text": "every token but the first"}\n')  # (nothing predicts the first)
    assert main(["data", f"dataset={tmp_path / 't.jsonl'}", "--samples", "1"]) == 0
    shown = capsys.readouterr().out.split("[[trained]])\n")[1].splitlines()[0]
    assert "[[" in shown and not shown.startswith("[[") and shown.replace("[[", "").startswith("every token")
    assert main(["data", "cutoff_len=16", "--samples", "0"]) == 0
    out = capsys.readouterr().out
    assert "--- sample" not in out and int(out.split("truncated ")[1].split()[0]) > 0
    assert main(["data", "--samples", "0", "cutoff_len=16"]) == 0  # (overrides after an option too)
    assert capsys.readouterr().out == out
    assert main(["data", "--samples", "0", "val_size=0.1"]) == 0  # (training's part and evaluation's, as train splits)
    out = capsys.readouterr().out
    assert "samples 101 " in out and "eval: samples 11 " in out
    assert main(["data", "--samples", "0", f"eval_dataset={_assets() / 'sample' / 'prompt_completion.jsonl'}"]) == 0
    out = capsys.readouterr().out
    assert "samples 112 " in out and "eval: samples 8 " in out
    assert main(["data", "--samples", "0", f"eval_dataset={_assets() / 'sample' / 'text.jsonl'}"]) == 2
    assert "eval_dataset " in capsys.readouterr().err  # (one of the dataset's files: evaluation of training samples)
    with pytest.raises(SystemExit) as e:
        main(["data", "--samples", "-1"])
    assert e.value.code == 2 and "--samples: must be a whole number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["data", "--samples", "0", "--bogus"])
    err = capsys.readouterr().err  # (the subcommand's help named: its options are the ones meant)
    assert e.value.code == 2 and "--bogus" in err and "slideformer data --help" in err, err
    assert main(["data", f"dataset={tmp_path / 'missing.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl" in err and "Traceback" not in err


def test_plan_for_several_processes_on_one_machine(capsys, monkeypatch):
    """--nproc-per-node: each GPU's figures at its own batch, one process's share of the host state and of
    the RAM, and the machine's RAM for them all."""
    import json

    from slideformer.plan.memory import PROCESS_BYTES

    base = ["plan", "--model", "llama3-8b", "--seq-len", "1024", "--batch-size", "32", "--gpu-memory", "24GiB",
            "--cpu-memory", "125GiB", "--optimizer-state", "compact", "--json"]
    assert main(base) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(base + ["--nproc-per-node", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["gpu"] == one["gpu"] and two["nproc_per_node"] == 2
    assert two["host"]["master"] == pytest.approx(one["host"]["master"] / 2, rel=1e-3)  # (the heavier rank)
    # (each process's share of the RAM, less its own bytes)
    assert two["host_state_limit"] == pytest.approx((one["host_state_limit"] + PROCESS_BYTES) / 2 - PROCESS_BYTES,
                                                    rel=1e-6)
    assert two["host_bytes"] < two["host_bytes_machine"] <= 2 * two["host_bytes"] + 2 * 2 * 2**30
    assert two["timing"]["h2d_s"] < one["timing"]["h2d_s"] and two["timing"]["peer_s"] > 0
    assert main(base[:-1] + ["--nproc-per-node", "2"]) == 0
    text = capsys.readouterr().out
    assert "per GPU, 2 processes" in text and "host of the machine" in text and "in all" in text
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # (auto: one per GPU, as train counts them)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # (inside a launcher's environment too)
    assert main(base + ["--nproc-per-node", "auto"]) == 0
    assert json.loads(capsys.readouterr().out) == two


def test_a_rank_ends_without_the_interpreters_finalization(monkeypatch, tmp_path):
    """Under a launcher a rank runs its exit handlers (an NVMe tier's files removed), leaves its code for our
    launcher, and ends through os._exit: in the interpreter's finalization a gloo thread still releasing a
    finished collective takes the GIL, which aborted the rank (SIGABRT after its error line) or could wait
    forever."""
    import atexit

    from slideformer import cli
    from slideformer.train.launch import EXIT_DIR

    ends = []
    monkeypatch.setattr(cli, "main", lambda: 2)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: ends.append("atexit"))
    monkeypatch.setattr(cli.os, "_exit", ends.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(EXIT_DIR, str(tmp_path))
    cli.entry()
    assert ends == ["atexit", 2] and (tmp_path / "1").read_text() == "2"
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: the interpreter ends as usual
    assert cli.entry() == 2 and ends == ["atexit", 2]


def test_plan_says_where_the_first_layers_update_runs_on_the_gpu(capsys):
    """With fp32 state and room on the GPU beside its peak (issue 20's 8B b32 case), the first streamed
    layer's update runs there (engine/resident.py VisitingUpdate); compact state keeps it on the CPU."""
    def placement(*extra):
        code = main(["plan", "--model", "llama3-8b", "--seq-len", "1024", "--batch-size", "32", "--gpu-memory",
                     "11.5GiB", "--cpu-memory", "125GiB", "--host-memory-limit", "103GiB", "--max-grad-norm", "0",
                     *extra])
        out = capsys.readouterr().out
        return code, next(line for line in out.splitlines() if line.startswith("placement:"))

    code, line = placement()
    assert code == 0 and "the first streamed layer's update on the GPU" in line
    code, line = placement("--optimizer-state", "compact")
    assert code == 0 and "update on the GPU" not in line


def test_a_model_transformers_runs_only_eagerly_trains_and_exports_with_eager_attention(tmp_path, capsys):
    """GPT-OSS runs its attention (with sinks) only through transformers' eager code: refused under SDPA with
    the setting that fixes it, which then trains, plans and exports (the planner's model and the export's
    layout once built under SDPA, refused again)."""
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from slideformer.train.config import _assets

    folder = tmp_path / "oss"
    shutil.copytree(_assets() / "tiny", folder)
    cfg = AutoConfig.for_model("gpt_oss", vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} of a few words"}) + "\n" for i in range(8)))
    run = ["train", "device=cpu", "progress=false", "max_steps=2", f"model_name_or_path={folder}",
           f"dataset={data}", "micro_batch_size=2", "cutoff_len=32"]
    assert main(run + [f"output_dir={tmp_path / 'a'}"]) == 2
    assert "set attn_implementation: eager" in capsys.readouterr().err
    assert main(run + [f"output_dir={tmp_path / 'b'}", "attn_implementation=eager"]) == 0
    assert main(["export", str(tmp_path / "b" / "checkpoint-2"), str(tmp_path / "hf")]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf") is not None
    assert main(["plan", "--model", str(folder), "--seq-len", "32", "--batch-size", "2", "--gpu-memory", "1GiB",
                 "--cpu-memory", "8GiB"]) == 0
