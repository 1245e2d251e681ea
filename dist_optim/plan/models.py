"""The models the planner and the recipe know, and the checks a model and a layout must pass
before ColossalAI sees them: one place, so that ``python -m dist_optim.plan`` and
``recipes/train_llama.py`` refuse the same input with the same one-line message (a
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
    "PlanError",
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

#: ``model_type`` values of the configs sharded here (ColossalAI's ShardFormer Llama policy).
SUPPORTED_TYPES = ("llama",)

#: Fields a config.json must give: transformers would otherwise default them (a 4096-wide model).
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


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
    if kind not in SUPPORTED_TYPES:
        raise PlanError(f"--model {model!r}: model_type {kind!r} in {file}; supported: {', '.join(SUPPORTED_TYPES)}")
    missing = [k for k in REQUIRED if not isinstance(raw.get(k), int) or raw[k] < 1]
    if missing:
        raise PlanError(
            f"--model {model!r}: {file} lacks a positive integer {', '.join(missing)} (every {kind} config gives them)"
        )
    try:
        return AutoConfig.from_pretrained(path or ".")
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise PlanError(f"--model {model!r}: transformers cannot read {file}: {exc}") from None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_model_layout(config: Any, tp: int = 1, pp: int = 1, sp: int = 1, sp_mode: str | None = None) -> None:
    """Refuse, naming the value and what is accepted, a layout ColossalAI's Llama policy would
    assert on: ``tp`` dividing the attention heads and the key/value heads (after ``sp`` divides
    them in the ``all_to_all`` mode), and no more pipeline stages than layers."""
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
    layers = int(config.num_hidden_layers)
    if pp > layers:
        raise PlanError(
            f"--pp {pp}: more pipeline stages than the model's {layers} layers; choose --pp at most {layers}"
        )
