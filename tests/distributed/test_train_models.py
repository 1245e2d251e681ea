"""recipes/train.py trains the other model types ColossalAI 0.5.0's ShardFormer has a policy
for: a tiny Mistral, a tiny Qwen2 (qkv bias, tied embeddings) and a tiny Mixtral
(4 experts, top-2; expert parallelism, MoeHybridParallelPlugin, is not in the recipe), each saved with
``save_pretrained`` beside an offline byte-level BPE tokenizer, loaded by the recipe under tp=2 on
2 CPU processes (gloo) and trained a few steps.

The first step's loss is the single-process Hugging Face model's on the same batch: the weights
arrived whole through ColossalAI's policy for the type (the biases of q/k/v, the one embedding a
tied model saves) and the sharded forward is the model's. The later steps lower the loss: the
optimizer steps every parameter of the sharded model."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from recipes import corpus, tokens
from tests.helpers.recipe import run_recipe

CORPUS = corpus.HELDOUT
SEQ_LEN, BATCH, STEPS, SEED = 32, 2, 6, 42

#: model_type -> (config class, model class, options beyond the shared tiny sizes).
TYPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, use_sliding_window=False)),
    # HybridParallelPlugin's Mixtral: attention and router split over tp, the 4 experts whole per rank.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False),
    ),
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer of 300 tokens trained offline on the recipes' held-out books."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tokenizer")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train([CORPUS], trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="</s>").save_pretrained(path)
    return path


def save_tiny(kind: str, directory: Path, tokenizer_dir: Path) -> torch.nn.Module:
    """A tiny model of ``kind`` (4 heads, 2 KV heads: tp=2 splits both) saved with its tokenizer."""
    import shutil

    import transformers
    from transformers import AutoTokenizer

    config_cls, model_cls, extra = TYPES[kind]
    shutil.copytree(tokenizer_dir, directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = getattr(transformers, config_cls)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # transformers zeroes biases; these must arrive to give the model's loss
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(std=0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_recipe_trains_a_saved_model_of_each_type_under_tp2(
    kind: str, tokenizer_dir: Path, pool2, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    directory = tmp_path / kind
    model = save_tiny(kind, directory, tokenizer_dir)
    if kind == "qwen2":  # what the issue asks of Qwen2: biased q/k/v, one embedding for input and output
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        assert model.lm_head.weight is model.model.embed_tokens.weight
    cache, log = str(tmp_path / "cache"), str(tmp_path / "train.csv")
    out = pool2.run(run_recipe, [
        "--model", str(directory), "--data", CORPUS, "--data-cache", cache, "--tp", "2", "--precision", "fp32",
        "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--steps", str(STEPS), "--seed", str(SEED),
        "--optimizer", "torch.optim.AdamW", "--lr", "1e-2", "--warmup", "1", "--no-progress", "--log-csv", log,
    ])[0]  # fmt: skip
    assert f"loaded pretrained weights from {directory}" in out and "tp=2" in out, out[-3000:]
    with open(log) as f:
        losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses

    # The single-process model on the recipe's first batch (one dp rank: the whole batch).
    tokenizer = AutoTokenizer.from_pretrained(directory)
    stream = tokens.build_token_file(tokens.expand_inputs([CORPUS]), tokenizer, cache).open()
    batch = tokens.PackedData(stream, SEQ_LEN, BATCH, 1, 0, SEED, eval_fraction=0.01).train_batch(0)
    model.config.use_cache = False
    with torch.no_grad():
        reference = float(model(input_ids=batch, labels=batch).loss)
    # fp32 under tp=2: the split reductions differ from one process by ~1e-7 relative; the CSV's 6
    # decimals round by 5e-7 (~1e-7 of a loss near ln(300) = 5.7). A weight that did not arrive
    # (re-initialised, a bias dropped, an untied head) moves the loss by far more.
    assert abs(losses[0] - reference) <= 2e-6 * reference, (kind, losses[0], reference)
    # AdamW at 1e-2 takes the randomly initialised model's loss down within a few steps.
    assert losses[-1] < losses[0] - 0.1, (kind, losses)


def test_recipe_refuses_the_types_the_planner_refuses(tmp_path: Path) -> None:
    """The recipe's refusal of a config.json's type is the planner's line (dist_optim.plan.models)."""
    import json

    from dist_optim.plan.models import PlanError, read_config
    from recipes.train import main

    for kind, message in (("qwen3", "has no ShardFormer policy for Qwen3 (qwen3)"), ("gpt2", "model_type 'gpt2'")):
        directory = tmp_path / kind
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({"model_type": kind, "hidden_size": 64}))
        with pytest.raises(PlanError) as planned:
            read_config(str(directory))
        with pytest.raises(SystemExit) as refused:
            main(["--model", str(directory), "--dry-run"])
        assert str(refused.value) == str(planned.value), (refused.value, planned.value)
        assert message in str(refused.value) and "supported: llama, mistral, qwen2, mixtral" in str(refused.value)
        assert "\n" not in str(refused.value)


def _dry_run_qwen2(tmp_path: Path) -> dict[str, Any]:
    import json

    from recipes import dry_run, train
    from tests.unit.test_plan_models import TINY

    (tmp_path / "config.json").write_text(
        json.dumps({**TINY, "model_type": "qwen2", "vocab_size": 300, "tie_word_embeddings": True})
    )
    args = train.parse_args(["--model", str(tmp_path), "--tp", "2", "--world-size", "2", "--dry-run"])
    return dry_run.dry_run(args)


def test_dry_run_counts_a_tied_embedding_once(tmp_path: Path) -> None:
    info = _dry_run_qwen2(tmp_path)
    hidden, inter, layers, vocab, kv = 64, 128, 2, 300, 32
    layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter  # q, o, k, v, MLP
    biases, norms = hidden + 2 * kv, 2 * hidden
    assert info["parameters"] == vocab * hidden + layers * (layer + biases + norms) + hidden
    # The matrices and the q/k/v biases halved (column-parallel), the norms whole on each rank.
    assert info["params_per_rank"] == [vocab * hidden // 2 + layers * ((layer + biases) // 2 + norms) + hidden]
    assert os.path.exists(tmp_path / "config.json")


def test_mfu_flops_count_a_mixtrals_active_experts_and_a_tied_head() -> None:
    """flops_per_token: 6 per parameter a token goes through (a Mixtral's top-k experts of its
    num_local_experts; a tied embedding, which is also the output head's matmul) + attention."""
    from transformers import MixtralConfig, Qwen2Config

    from recipes.metrics import flops_per_token

    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    mixtral = MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2)
    attention = 12.0 * 2 * 64 * 32
    idle = 2 * 2 * 3 * 64 * 96  # 2 layers x 2 idle experts x 3 matrices
    assert flops_per_token(mixtral, 1_000_000, 32) == 6.0 * (1_000_000 - 300 * 64 - idle) + attention
    tied = Qwen2Config(**sizes, tie_word_embeddings=True)
    assert flops_per_token(tied, 1_000_000, 32) == 6.0 * 1_000_000 + attention
