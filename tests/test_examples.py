"""examples/: every config loads and trains as written, its model aside (the bundled tiny model here, whose
positions end at 256)."""
from pathlib import Path

import pytest

from slideformer.train.config import load_config
from slideformer.train.loop import train

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_each_example_trains(path, tmp_path):
    text = path.read_text()
    extra = [f"offload.offload_dir={tmp_path / 'nvme'}"] if "offload_dir" in text else []
    extra += ["eval_steps=1"] if "val_size" in text or "eval_dataset" in text else []
    cfg = load_config(path, ["model_name_or_path=tiny", "cutoff_len=256", "device=cpu", "bf16=true", "max_steps=2",
                             "progress=false", f"output_dir={tmp_path / 'run'}", *extra])
    result = train(cfg)
    assert result["status"] == "finished" and result["steps"] == 2


def test_there_are_examples():
    assert {p.stem for p in EXAMPLES} >= {"qwen3-4b-24gb", "llama3.1-8b-24gb", "qwen2.5-14b-nvme", "data-alpaca",
                                          "data-sharegpt", "data-messages", "data-text", "llama3.1-8b-2gpus"}


def test_the_several_gpus_example_trains_under_two_ranks(tmp_path):
    """As its comment runs it (torchrun, 2 processes; gloo on the CPU here): both ranks take the same steps."""
    import torch

    from test_parallel import _trainer_rank, torchrun_job

    path = next(p for p in EXAMPLES if p.stem == "llama3.1-8b-2gpus")
    assert "torchrun --nproc-per-node 2 -m slideformer train examples/llama3.1-8b-2gpus.yaml" in path.read_text()
    overrides = ["model_name_or_path=tiny", "cutoff_len=256", "device=cpu", "bf16=true", "max_steps=2", "logging_steps=1",
                 "progress=false", f"output_dir={tmp_path / 'run'}"]
    outs = [str(tmp_path / f"r{r}.pt") for r in range(2)]
    procs = torchrun_job(_trainer_rank, lambda r, port: (r, 2, port, overrides, outs[r], str(path)))
    assert [p.exitcode for p in procs] == [0, 0]
    first, second = (torch.load(o) for o in outs)
    assert len(first["losses"]) == 2 and first["losses"] == second["losses"]
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
