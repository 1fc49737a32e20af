"""Model shapes used by benchmarks and the planner, as Hugging Face configs (no download). The largest are for
`slideformer plan` on paper: their layers are built on the meta device only."""
from __future__ import annotations

from importlib import resources


def preset_config(name: str):
    from transformers import (AutoConfig, Gemma3TextConfig, LlamaConfig, MistralConfig, OlmoeConfig, Phi3Config,
                              Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    if name == "qwen3-4b":
        return Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                           rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    if name == "llama3-8b":
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                           rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if name == "qwen2.5-14b":
        return Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                           num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
                           rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if name == "qwen2.5-32b":
        return Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                           num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
                           rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if name == "mistral-small-24b":  # Mistral-Small-24B-Base-2501's shape, 23.6B
        return MistralConfig(vocab_size=131072, hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=32768, rope_theta=100_000_000.0, rms_norm_eps=1e-5,
                             sliding_window=None, tie_word_embeddings=False)
    if name == "gemma2-27b-shape":  # Gemma-2-27B's sizes (27.2B, tied head) on a Llama layer: its soft-capping aside
        return LlamaConfig(vocab_size=256000, hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                           num_attention_heads=32, num_key_value_heads=16, head_dim=128, max_position_embeddings=8192,
                           rope_theta=10_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    if name == "llama3.1-70b":
        return LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
                           rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if name == "mistral-large-2":  # Mistral-Large-Instruct-2407's shape, 123B
        return MistralConfig(vocab_size=32768, hidden_size=12288, intermediate_size=28672, num_hidden_layers=88,
                             num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=131072, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                             sliding_window=None, tie_word_embeddings=False)
    if name == "llama3.1-405b":
        return LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072,
                           rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if name == "gemma3-4b":  # Gemma-3-4B's language model: 3.9B, 5 sliding-window layers to each global one
        return Gemma3TextConfig(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                                sliding_window=1024, max_position_embeddings=131072, rope_theta=1_000_000.0,
                                rms_norm_eps=1e-6, tie_word_embeddings=True)
    if name == "phi4-mini":  # Phi-4-mini's shape: 3.8B, partial rotary, tied head (its long-context RoPE scaling aside)
        return Phi3Config(vocab_size=200064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                          num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
                          max_position_embeddings=131072, rope_theta=10_000.0, rms_norm_eps=1e-5,
                          pad_token_id=199999, bos_token_id=199999, eos_token_id=199999, tie_word_embeddings=True)
    if name == "olmoe-1b-7b":  # OLMoE-1B-7B-0924's shape: 6.9B, 1.3B active (64 experts, 8 a token)
        return OlmoeConfig(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                           num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                           max_position_embeddings=4096, rope_theta=10_000.0, rms_norm_eps=1e-5,
                           pad_token_id=1, bos_token_id=None, eos_token_id=50279, tie_word_embeddings=False)
    if name == "qwen3-30b-a3b":  # Qwen3-30B-A3B's shape: 30.5B, 3.3B active (128 experts, 8 a token)
        return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                              num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                              max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                              tie_word_embeddings=False)
    if name == "tiny":
        return AutoConfig.from_pretrained(str(resources.files("slideformer") / "assets" / "tiny"))
    raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")


PRESETS = ("qwen3-4b", "llama3-8b", "qwen2.5-14b", "mistral-small-24b", "gemma2-27b-shape", "qwen2.5-32b", "llama3.1-70b", "mistral-large-2", "llama3.1-405b",
           "gemma3-4b", "phi4-mini", "olmoe-1b-7b", "qwen3-30b-a3b", "tiny")
