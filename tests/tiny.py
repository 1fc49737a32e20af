"""Tiny configs of every supported family, built offline in milliseconds."""
import contextlib
import signal

import torch
from transformers import (AutoModelForCausalLM, CohereConfig, Gemma2Config, Gemma3TextConfig, GemmaConfig, Glm4Config,
                          GraniteConfig, HyperCLOVAXConfig, LlamaConfig, MistralConfig, MixtralConfig, Olmo2Config,
                          OlmoeConfig, Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)

FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen2-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    "qwen3-tied": lambda: Qwen3Config(**COMMON, head_dim=8, tie_word_embeddings=True),
    "mistral-sliding": lambda: MistralConfig(**COMMON, sliding_window=5, tie_word_embeddings=False),
    # post-norms around attention and MLP (the down projection's output is normalised), q/k norms
    "olmo2": lambda: Olmo2Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
    # fused qkv and gate_up projections
    "phi3": lambda: Phi3Config(**COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
    # multipliers: the embedding's and the logits' (the engine repeats them), the residuals' and attention's
    "granite": lambda: GraniteConfig(**COMMON, embedding_multiplier=3.0, logits_scaling=2.5, residual_multiplier=0.6,
                                     attention_multiplier=0.2, tie_word_embeddings=True),
    # attention and MLP in parallel from one LayerNorm; the logits multiplied (logit_scale)
    "cohere": lambda: CohereConfig(**COMMON, logit_scale=0.5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                   tie_word_embeddings=True),
    # an embedding that scales itself, (1 + w) norms around attention and MLP, sliding and full layers each
    # with their own rotary frequencies
    "gemma3": lambda: Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 4}, head_dim=8, sliding_window=5,
                                       layer_types=["sliding_attention", "full_attention"] * 2,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True),
    # a self-scaling embedding, (1 + w) norms, GeGLU
    "gemma": lambda: GemmaConfig(**COMMON, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                 tie_word_embeddings=True),
    # soft-capped logits and attention scores (eager attention: SDPA cannot cap), four norms a layer, sliding
    # and full layers; caps low enough that the tiny model's logits and scores reach them
    "gemma2": lambda: Gemma2Config(**{**COMMON, "num_hidden_layers": 4}, head_dim=8, sliding_window=5,
                                   final_logit_softcapping=0.5, attn_logit_softcapping=0.05, query_pre_attn_scalar=1,
                                   pad_token_id=0,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True),
    # Mixture-of-Experts: 4 experts, 2 a token, as 3-D parameters; the router's load-balancing loss (a large
    # coefficient, so that its gradient is not lost in rounding) in two of them
    "qwen3-moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=16, output_router_logits=True,
                                        router_aux_loss_coef=0.5, tie_word_embeddings=False),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                     router_aux_loss_coef=0.5, tie_word_embeddings=True),
    "olmoe": lambda: OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                                 eos_token_id=2, tie_word_embeddings=False),
}

# Families found by structure only (no fused ops, no named support): each one a way a layer or the model's
# forward differs that the engine must follow or refuse, trained against plain PyTorch too.
BY_STRUCTURE = {
    # a norm after the MLP under another name than Gemma's (the down projection's output is read)
    "glm4": lambda: Glm4Config(**COMMON, head_dim=8, pad_token_id=0, tie_word_embeddings=False),
    # a window without layer_types: the model's forward slides every layer
    "phi3-sliding": lambda: Phi3Config(**COMMON, sliding_window=5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                       tie_word_embeddings=False),
    "mixtral-sliding": lambda: MixtralConfig(**COMMON, sliding_window=5, num_local_experts=4, num_experts_per_tok=2,
                                             tie_word_embeddings=False),
    # post-norms by other names, and logits multiplied by logits_scaling (Granite divides by it)
    "hyperclovax": lambda: HyperCLOVAXConfig(**COMMON, head_dim=8, logits_scaling=2.5, pad_token_id=0,
                                             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
}


def attention(cfg) -> str:
    """The attention a reference model runs: SDPA, or eager where scores are soft-capped (SDPA cannot)."""
    return "eager" if getattr(cfg, "attn_logit_softcapping", None) else "sdpa"


def build(family: str, seed: int = 0):
    cfg = {**FAMILIES, **BY_STRUCTURE}[family]()
    cfg._attn_implementation = attention(cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    # Make norms and biases non-trivial, so that their gradients and updates are checked too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(vocab: int, b: int = 2, s: int = 12, seed: int = 0, ignore: bool = True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    labels = ids.clone()
    if ignore:
        labels[:, : s // 3] = -100  # a prompt that is not trained on
    return {"input_ids": ids, "labels": labels}


def engine_config(**flat):
    """An EngineConfig from one flat set of keys, placement and tuning keys by their own names: for tests
    that vary any of them from one dict."""
    from dataclasses import fields

    from slideformer.config import EngineConfig, Placement, Tuning

    nested = {name: cls(**{f.name: flat.pop(f.name) for f in fields(cls) if f.name in flat})
              for name, cls in (("placement", Placement), ("tuning", Tuning))}
    return EngineConfig(**flat, **nested)


def kill_during_second_save(ck, cfg: dict, first_steps: int) -> None:
    """A child process trains ``first_steps`` steps (batch(97, seed=s)) with engine_config(**cfg), saves a
    checkpoint at ``ck`` ({"next": first_steps}), trains one more step and is SIGKILLed in the middle of its
    second save, right after layer1's state file is written."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from tiny import batch, build, engine_config
        from slideformer import SlideEngine
        from slideformer.checkpoint import state
        eng = SlideEngine(build("llama"), engine_config(**{cfg!r}))
        for s in range({first_steps}):
            eng.train_step(batch(97, seed=s))
        eng.save_checkpoint({str(ck)!r}, {{"next": {first_steps}}})
        eng.train_step(batch(97, seed={first_steps}))
        real = state.save_file
        def dying(tensors, path, *a, **k):
            real(tensors, path, *a, **k)
            if path.endswith("layer1.safetensors"):
                os.kill(os.getpid(), signal.SIGKILL)
        state.save_file = dying
        eng.save_checkpoint({str(ck)!r}, {{"next": {first_steps + 1}}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc): a launcher's ranks."""
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


@contextlib.contextmanager
def within(seconds: int, what: str):
    """What runs inside fails with TimeoutError(``what``) past ``seconds`` (a hang made a failure)."""
    def hung(*a):
        raise TimeoutError(what)
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
