"""The models the planner and the recipe know, and the checks a model and a layout must pass
before ColossalAI sees them: one place, so that ``python -m dist_optim.plan`` and
``recipes/train.py`` refuse the same input with the same one-line message (a
:class:`PlanError`), where ColossalAI would fail with an ``AssertionError`` on rank 0 or
transformers would fill a missing field with a default and plan another model."""

from __future__ import annotations

import json
import math
import os
from typing import Any

__all__ = [
    "MODELS",
    "SUPPORTED_TYPES",
    "MOE_TYPES",
    "PlanError",
    "check_model_type",
    "vocab_multiple",
    "load_config",
    "llama_config",
    "read_config",
    "check_model_layout",
]


class PlanError(ValueError):
    """Bad input to the planner: the message names the value and what is accepted."""


# Llama-2 (Touvron et al. 2023, the released config.json files): hidden, intermediate, layers,
# heads, kv heads, vocab.
MODELS: dict[str, tuple[int, int, int, int, int, int]] = {
    "llama-7b": (4096, 11008, 32, 32, 32, 32000),
    "llama-13b": (5120, 13824, 40, 40, 40, 32000),
    "llama-70b": (8192, 28672, 80, 64, 8, 32000),
}

#: ``model_type`` values of the configs sharded here: those of ColossalAI 0.5.0's ShardFormer
#: policies for a causal LM (``colossalai/shardformer/policies/auto_policy.py``) that the planner's
#: simulation and the recipe are tested with (tests/unit/test_plan_models.py checks each has a policy).
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "mixtral")

#: The supported types with experts (their MoE blocks; expert parallelism is MoeHybridParallelPlugin's).
MOE_TYPES = ("mixtral",)

#: Types whose ColossalAI 0.5.0 policy shards the output head as a plain column-parallel linear
#: (``Linear1D_Col``, no padding of its own). Tied to the embedding, which ShardFormer pads to a
#: multiple of ``make_vocab_size_divisible_by`` x tp, the head then computes the padded rows as
#: logits of zero that enter the softmax, so a tied model trains on a loss above its own (the padded
#: rows take a share of every token's probability). :func:`vocab_multiple` turns that padding off for them.
PLAIN_HEAD_TYPES = ("qwen2", "mixtral")

#: HybridParallelPlugin's default ``make_vocab_size_divisible_by`` (a faster kernel's multiple).
VOCAB_MULTIPLE = 64

#: Types people ask for that ColossalAI cannot shard: the reason, said in the refusal. Qwen3
#: (``Qwen3ForCausalLM``) has no entry in 0.5.0's ``_POLICY_LIST``; ShardFormer would fail on rank 0.
NO_POLICY = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE"}

#: Fields a config.json must give: transformers would otherwise default them (a 4096-wide model,
#: or a Mixtral's 8 experts, top-2).
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
REQUIRED_MOE = ("num_local_experts", "num_experts_per_tok")


def load_config(model: Any) -> Any:
    """A ``LlamaConfig`` from a name of :data:`MODELS`, a path to a ``config.json`` (or its
    directory, :func:`read_config`), or a config object (returned as it is)."""
    if not isinstance(model, str):
        return model
    if model in MODELS:
        return llama_config(*MODELS[model])
    return read_config(model)


def llama_config(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Any:
    """A ``LlamaConfig`` of these sizes (the order of :data:`MODELS` and the recipe's presets),
    4096 positions, untied embeddings (as Llama-2)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def read_config(model: str) -> Any:
    """The config of ``model``, a ``config.json`` or a directory holding one, checked: valid JSON,
    an object, a :data:`SUPPORTED_TYPES` ``model_type`` and the :data:`REQUIRED` fields."""
    from transformers import AutoConfig

    path = os.path.dirname(model) if os.path.basename(model) == "config.json" else model
    file = os.path.join(path or ".", "config.json")
    if not os.path.isfile(file):
        raise PlanError(
            f"--model {model!r}: no config.json there; give one of {', '.join(MODELS)}, "
            "a model directory or a path to its config.json"
        )
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"--model {model!r}: {file} is not valid JSON ({exc}); fix or replace the file") from None
    if not isinstance(raw, dict):
        raise PlanError(f"--model {model!r}: {file} holds a JSON {type(raw).__name__}, not an object of config fields")
    kind = raw.get("model_type")
    check_model_type(kind, f"--model {model!r}: model_type {kind!r} in {file}")
    required = REQUIRED + (REQUIRED_MOE if kind in MOE_TYPES else ())
    missing = [k for k in required if not isinstance(raw.get(k), int) or raw[k] < 1]
    if missing:
        raise PlanError(
            f"--model {model!r}: {file} lacks a positive integer {', '.join(missing)} (every {kind} config gives them)"
        )
    try:
        return AutoConfig.from_pretrained(path or ".")
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise PlanError(f"--model {model!r}: transformers cannot read {file}: {exc}") from None


def check_model_type(kind: Any, what: str) -> None:
    """Refuse a ``model_type`` outside :data:`SUPPORTED_TYPES` in one line starting with ``what``:
    why (no ShardFormer policy in the installed ColossalAI, for the types people ask for) and the
    supported types. Shared by the planner and the recipe, so both refuse with the same words."""
    if kind in SUPPORTED_TYPES:
        return
    supported = f"supported: {', '.join(SUPPORTED_TYPES)}"
    if isinstance(kind, str) and kind in NO_POLICY:
        raise PlanError(
            f"{what}: ColossalAI {_colossalai_version()} has no ShardFormer policy for {NO_POLICY[kind]} "
            f"({kind}); {supported}"
        )
    raise PlanError(f"{what}; {supported}")


def _colossalai_version() -> str:
    """The installed ColossalAI's version, read without importing it (its import takes seconds)."""
    from importlib import metadata

    try:
        return metadata.version("colossalai")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _padding_breaks_tie(config: Any) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False)) and getattr(config, "model_type", "") in PLAIN_HEAD_TYPES


def vocab_multiple(config: Any) -> int:
    """The ``make_vocab_size_divisible_by`` that HybridParallelPlugin (the recipe) and the planner's
    ShardConfig give ShardFormer for ``config``: the plugin's default, except 1 for a tied
    embedding under a plain column-parallel head (:data:`PLAIN_HEAD_TYPES`), whose padded rows
    would enter the loss; :func:`check_model_layout` then asks ``tp`` to divide the vocabulary."""
    return 1 if _padding_breaks_tie(config) else VOCAB_MULTIPLE


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_model_layout(
    config: Any, tp: int = 1, pp: int = 1, sp: int = 1, sp_mode: str | None = None, ep: int = 1, chunks: int = 1
) -> None:
    """Refuse, naming the value and what is accepted, a layout ColossalAI's policies (Llama,
    Mistral, Qwen2, Mixtral: the same head checks) would assert on: ``tp`` dividing the attention
    heads and the key/value heads (after ``sp`` divides them in the ``all_to_all`` mode), no more
    pipeline stages than layers (under the interleaved schedule, no more stages x ``chunks`` model chunks
    than layers: ColossalAI spreads a remainder, so divisibility is not needed, but it would leave a
    chunk without layers), and ``ep`` dividing the experts of an MoE model (a dense model has
    none to split). The layout's own conditions on ``ep`` are :class:`~dist_optim.plan.world.Layout`'s."""
    if ep != 1:
        kind = getattr(config, "model_type", "llama")
        if kind not in MOE_TYPES:
            raise PlanError(
                f"--ep {ep}: a {kind} model has no experts; --ep above 1 needs an MoE model "
                f"({', '.join(MOE_TYPES)}); plan with --ep 1"
            )
        experts = int(config.num_local_experts)
        if experts % ep:
            # ColossalAI's EP MoE block raises on rank 0 otherwise ("The number of experts must be
            # divisible by the number of expert parallel groups").
            raise PlanError(
                f"--ep {ep}: must divide the model's {experts} experts; choose --ep among "
                f"{', '.join(map(str, _divisors(experts)))}"
            )
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if sp_mode == "all_to_all" and sp > 1:
        if heads % sp or kv % sp:
            raise PlanError(
                f"--sp {sp}: sequence parallelism all_to_all splits the model's {heads} attention heads and {kv} "
                f"key/value heads; choose --sp among {', '.join(map(str, _divisors(math.gcd(heads, kv))))}"
            )
        heads, kv = heads // sp, kv // sp
    if heads % tp or kv % tp:
        raise PlanError(
            f"--tp {tp}: must divide the model's {heads} attention heads and {kv} key/value heads; "
            f"choose --tp among {', '.join(map(str, _divisors(math.gcd(heads, kv))))}"
        )
    vocab = int(config.vocab_size)
    if tp > 1 and _padding_breaks_tie(config) and vocab % tp:
        raise PlanError(
            f"--tp {tp}: must divide the {vocab}-token vocabulary of this {config.model_type} model with tied "
            "embeddings (ColossalAI's padding rows would enter its loss); choose --tp among "
            f"{', '.join(map(str, _divisors(math.gcd(heads, kv, vocab))))}"
        )
    layers = int(config.num_hidden_layers)
    if pp > layers:
        raise PlanError(
            f"--pp {pp}: more pipeline stages than the model's {layers} layers; choose --pp at most {layers}"
        )
    if pp * chunks > layers:
        raise PlanError(
            f"--num-model-chunks {chunks} with --pp {pp}: {pp * chunks} model chunks for the model's {layers} layers "
            f"(ColossalAI would leave a chunk without layers); choose --num-model-chunks at most {layers // pp}"
        )
