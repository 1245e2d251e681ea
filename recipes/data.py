"""The run's batches: synthetic tokens, or text files tokenized once into a cached token file
(:mod:`recipes.tokens`), with their held-out part."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recipes.env import log

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class Synthetic:
    """Random tokens: micro-step s always yields the same global batch; each dp rank its slice."""

    vocab: int
    seq_len: int
    batch: int
    dp_size: int
    dp_rank: int
    seed: int
    num_eval: int = 0

    def train_batch(self, micro_step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + micro_step)
        full = torch.randint(0, self.vocab, (self.batch * self.dp_size, self.seq_len), generator=gen)
        return full[self.dp_rank * self.batch : (self.dp_rank + 1) * self.batch]

    def eval_batches(self, max_sequences: int = 0) -> list[torch.Tensor]:
        return []


def resolve_tokenizer(args: argparse.Namespace) -> str | None:
    """The tokenizer directory: --tokenizer, else the model directory when it holds a tokenizer,
    else None (byte tokens)."""
    if args.tokenizer:
        if not os.path.isdir(args.tokenizer):
            raise SystemExit(f"--tokenizer {args.tokenizer!r}: not a directory")
        return args.tokenizer
    if os.path.isdir(args.model) and any(os.path.exists(os.path.join(args.model, f)) for f in TOKENIZER_FILES):
        return args.model
    return None


def expand(paths: list[str], flag: str) -> list[str]:
    """:func:`recipes.tokens.expand_inputs`, a bad path refused in its one line."""
    from recipes import tokens

    try:
        return tokens.expand_inputs(paths, flag)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def data_files(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """(training files, held-out files or None): --data and --eval-data, by default the books of
    recipes/corpus.py and their held-out part; a missing path or corpus is refused in one line."""
    from recipes import corpus

    if args.data is None and not corpus.installed():
        raise SystemExit(corpus.missing_message())
    held = args.eval_data or ([corpus.HELDOUT] if args.data is None else None)
    train = expand(args.data or [corpus.TRAIN], "--data")
    return train, None if held is None else expand(held, "--eval-data")


def tokenize(files: list[str], args: argparse.Namespace, vocab: int) -> Any:
    """The files' tokens: bytes without a tokenizer, else the cached token file under it (built by
    one process per node while the others wait)."""
    from recipes import tokens

    tok_dir = resolve_tokenizer(args)
    if tok_dir is None:
        if vocab < 256:
            raise SystemExit("byte-level text needs a vocabulary of at least 256; give --tokenizer")
        data = tokens.byte_tokens(files)
        log(f"data: {len(files)} file(s), {len(data)} byte tokens (no tokenizer)")
        return data
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    if len(tokenizer) > vocab:
        raise SystemExit(f"--tokenizer {tok_dir}: {len(tokenizer)} tokens do not fit the model's vocabulary of {vocab}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank == 0:
        built = tokens.build_token_file(files, tokenizer, args.data_cache)
    dist.barrier()
    if local_rank != 0:
        built = tokens.build_token_file(files, tokenizer, args.data_cache, build=False)
    dist.barrier()
    verb = "reusing token cache" if built.reused else "tokenized into"
    log(f"data: {len(files)} file(s), {built.num_tokens} tokens, {verb} {built.path}")
    return built.open()


def load_data(args: argparse.Namespace, vocab: int, dp_size: int, dp_rank: int) -> Any:
    """The run's batches: synthetic, or the tokens of the training files with the held-out ones
    (:func:`data_files`)."""
    from recipes import tokens

    if args.synthetic:
        return Synthetic(vocab, args.seq_len, args.batch_size, dp_size, dp_rank, args.seed)
    train_files, eval_files = data_files(args)
    data = tokenize(train_files, args, vocab)
    held = None if eval_files is None else tokenize(eval_files, args, vocab)
    try:
        packed = tokens.PackedData(
            data, args.seq_len, args.batch_size, dp_size, dp_rank, args.seed, args.eval_fraction, held
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if args.eval_every > 0 and packed.num_eval < dp_size:
        fix = "give more held-out text" if held is not None else "raise --eval-fraction or give more data"
        raise SystemExit(
            f"--eval-every: {packed.num_eval} held-out sequences, fewer than the {dp_size} data-parallel ranks; {fix}"
        )
    log(f"data: {packed.num_train} training and {packed.num_eval} held-out sequences of {args.seq_len} tokens")
    return packed


def dp_coords(plugin: Any) -> tuple[int, int]:
    group = getattr(plugin, "dp_group", None)
    return dist.get_world_size(group), dist.get_rank(group)
