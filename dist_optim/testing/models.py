"""Tiny Hugging Face causal language models for tests and benchmarks: small enough to train on CPU
processes in seconds, shaped as the real ones (attention with 4 heads, gated MLP, untied embedding
and head), so that ShardFormer splits them as it splits a production model.

``transformers`` is imported when a model is built, not with this module.
"""

from __future__ import annotations

from typing import Any

import torch

#: The tiny models' vocabulary unless a caller asks for another.
VOCAB = 256


def _tiny_causal_lm(
    config_cls: str, model_cls: str, hidden: int, inter: int, layers: int, vocab: int, **extra: Any
) -> Any:
    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config)


def tiny_llama(hidden: int = 64, inter: int = 128, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny ``LlamaForCausalLM`` (eager attention, no KV cache), initialised after
    ``torch.manual_seed(0)``: the same weights on every rank and every call."""
    return _tiny_causal_lm("LlamaConfig", "LlamaForCausalLM", hidden, inter, layers, vocab)


def tiny_mixtral(hidden: int = 64, inter: int = 96, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny Mixtral (4 experts, top-2) for MoeHybridParallelPlugin, seeded as :func:`tiny_llama`."""
    return _tiny_causal_lm(
        "MixtralConfig", "MixtralForCausalLM", hidden, inter, layers, vocab, num_local_experts=4, num_experts_per_tok=2
    )
