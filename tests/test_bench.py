"""The benchmark harness runs end to end (on the CPU, tiny model), so it cannot rot between GPU runs."""
import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def harness():
    path = Path(__file__).resolve().parents[1] / "bench" / "harness.py"
    spec = importlib.util.spec_from_file_location("harness", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("system", ["slideformer", "plain"])
def test_harness_cpu_smoke(harness, system, tmp_path):
    out = tmp_path / "r.jsonl"
    rec = harness.main(["--system", system, "--model", "tiny", "--device", "cpu", "--seq", "32", "--batch", "2",
                        "--warmup", "1", "--steps", "2", "--out", str(out)])
    assert rec["tokens_per_s"] > 0 and rec["params"] > 0 and out.read_text().count("\n") == 1
    if system == "slideformer":
        assert set(rec["host_bytes"]) >= {"host_master", "host_moments", "host_grads"}
