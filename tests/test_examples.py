"""examples/: every config loads and trains as written, its model aside (the bundled tiny model here, whose
positions end at 256)."""
from pathlib import Path

import pytest

from slideformer.train.config import load_config
from slideformer.train.loop import train

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
# (an example's host budget is its machine's: over this one's RAM, train refuses it)
HOST_LIMIT = ["offload.host_memory_limit=null"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_trains(path, tmp_path):
    text = path.read_text()
    extra = [f"offload.offload_dir={tmp_path / 'nvme'}"] if "offload_dir" in text else []
    extra += ["eval_steps=1"] if "val_size" in text or "eval_dataset" in text else []
    extra += HOST_LIMIT if "host_memory_limit" in text else []
    cfg = load_config(path, ["model_name_or_path=tiny", "cutoff_len=256", "device=cpu", "bf16=true", "max_steps=2",
                             "progress=false", f"output_dir={tmp_path / 'run'}", *extra])
    result = train(cfg)
    assert result["status"] == "finished" and result["steps"] == 2


def test_there_are_examples():
    assert {p.stem for p in EXAMPLES} >= {"qwen3-4b-24gb", "llama3.1-8b-24gb", "qwen2.5-14b-nvme", "data-alpaca",
                                          "data-sharegpt", "data-messages", "data-text", "data-prompt-completion",
                                          "data-columns", "llama3.1-8b-2gpus"}


def test_the_several_gpus_example_trains_as_its_comment_runs_it(tmp_path):
    """`slideformer train` with the example (its nproc_per_node: 2 starts two ranks; gloo on the CPU here)."""
    import os
    import subprocess
    import sys

    path = next(p for p in EXAMPLES if p.stem == "llama3.1-8b-2gpus")
    assert "#   slideformer train examples/llama3.1-8b-2gpus.yaml" in path.read_text()
    overrides = ["model_name_or_path=tiny", "cutoff_len=256", "device=cpu", "bf16=true", "max_steps=2", "logging_steps=1",
                 "progress=false", f"output_dir={tmp_path / 'run'}", *HOST_LIMIT]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    p = subprocess.run([sys.executable, "-m", "slideformer", "train", str(path), *overrides], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "(rank 0 of 2)" in p.stdout and p.stdout.count("step 2/2") == 1
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
