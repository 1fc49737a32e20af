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
                                          "data-sharegpt", "data-messages", "data-text"}
