"""`slideformer train` with no arguments is the demo: it must train and export a loadable model."""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from slideformer.cli import main


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
