"""Training data for the recipes: text files tokenized once into a cached memory-mapped token file,
packed into fixed-length sequences, split into train and held-out parts, each data-parallel rank
reading its own part of every global batch.

Inputs are ``.txt`` files (each file is one document) and ``.jsonl`` files (one JSON object per
line, its ``text`` field is one document), or directories searched recursively for both. Every
document is tokenized without special tokens and followed by the tokenizer's end-of-text token, so
packed sequences cross document boundaries at an EOS separator (the usual pre-training packing,
e.g. GPT-3, Brown et al. 2020, section 2.2). Without a tokenizer the bytes of the text are the
tokens (vocabulary 256, no separator): the zero-download default for the demo.

The token file is keyed by the input files' absolute paths, sizes and modification times and by
the tokenizer's full serialisation, so changing a file or the tokenizer re-tokenizes, and a second
run with the same inputs maps the existing file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
SUFFIXES = (".txt", ".jsonl")
_BATCH_DOCS = 256  # documents per tokenizer call: the fast tokenizers parallelise within a call


def expand_inputs(paths: Sequence[str], flag: str = "--data") -> list[str]:
    """The ``.txt`` / ``.jsonl`` files named by ``paths`` (files, or directories searched recursively),
    in a fixed order: the order given, sorted within each directory; errors name ``flag``."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                os.path.join(d, name) for d, _, names in os.walk(path) for name in names if name.endswith(SUFFIXES)
            )
            if not found:
                raise ValueError(f"{flag} {path!r}: the directory holds no .txt or .jsonl file")
            files += found
        elif os.path.isfile(path):
            if not path.endswith(SUFFIXES):
                raise ValueError(f"{flag} {path!r}: expected a .txt or .jsonl file (or a directory of them)")
            files.append(path)
        else:
            raise ValueError(f"{flag} {path!r}: no such file or directory")
    return [os.path.abspath(f) for f in files]


def iter_documents(path: str) -> Iterator[str]:
    """The documents of one input file: the whole text of a ``.txt`` file, the ``text`` field of
    every non-empty line of a ``.jsonl`` file."""
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            yield f.read()
        return
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"--data {path}:{lineno}: each line must be a JSON object with a string 'text' field")
            yield record["text"]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything that decides the tokens: the fast tokenizer's full serialisation
    (vocabulary, merges, normalisation, pre-tokenisation), else the sorted vocabulary, and EOS."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{body}|eos={tokenizer.eos_token_id}".encode()).hexdigest()


def eos_id(tokenizer: Any) -> int:
    token = getattr(tokenizer, "eos_token_id", None)
    if token is None:
        raise ValueError("--tokenizer: the tokenizer has no eos_token; set one in its tokenizer_config.json")
    return int(token)


def encode_documents(tokenizer: Any, docs: Sequence[str]) -> list[int]:
    """Each document's tokens (no special tokens) followed by EOS, concatenated: the stream the
    cache stores, also what a test compares against."""
    eos = eos_id(tokenizer)
    out: list[int] = []
    for ids in tokenizer(list(docs), add_special_tokens=False)["input_ids"]:
        out += ids
        out.append(eos)
    return out


@dataclass(frozen=True)
class TokenFile:
    """A tokenized corpus on disk: ``path`` is a flat array of ``dtype`` token ids."""

    path: str
    dtype: str
    num_tokens: int
    reused: bool

    def open(self) -> np.ndarray:
        if self.num_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))


def cache_key(files: Sequence[str], tokenizer: Any) -> str:
    h = hashlib.sha256(f"v{FORMAT_VERSION}|{tokenizer_fingerprint(tokenizer)}".encode())
    for f in files:
        st = os.stat(f)
        h.update(f"|{f}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def build_token_file(files: Sequence[str], tokenizer: Any, cache_dir: str, build: bool = True) -> TokenFile:
    """The cached token file for ``files`` under ``tokenizer``; tokenize into it first if it is
    missing and ``build`` (only one process per node builds; the others wait, then call with
    ``build=False``). The file is written under a temporary name and renamed, so a reader never
    maps a partial file."""
    key = cache_key(files, tokenizer)
    path = os.path.join(cache_dir, f"tokens-{key}.bin")
    meta_path = path[: -len(".bin")] + ".json"
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        return TokenFile(path, meta["dtype"], int(meta["num_tokens"]), reused=True)
    if not build:
        raise FileNotFoundError(f"token cache {meta_path} was not written by the building process")
    vocab = len(tokenizer)
    dtype = "uint16" if vocab <= np.iinfo(np.uint16).max + 1 else "uint32"
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    num_tokens = num_docs = 0
    with open(tmp, "wb") as out:
        for f in files:
            batch: list[str] = []
            for doc in iter_documents(f):
                batch.append(doc)
                if len(batch) == _BATCH_DOCS:
                    num_tokens += _write(out, encode_documents(tokenizer, batch), dtype)
                    num_docs += len(batch)
                    batch = []
            if batch:
                num_tokens += _write(out, encode_documents(tokenizer, batch), dtype)
                num_docs += len(batch)
    os.replace(tmp, path)
    meta = {"dtype": dtype, "num_tokens": num_tokens, "num_documents": num_docs, "files": list(files)}
    with open(meta_path + f".tmp{os.getpid()}", "w") as f:
        json.dump(meta, f)
    os.replace(meta_path + f".tmp{os.getpid()}", meta_path)
    return TokenFile(path, dtype, num_tokens, reused=False)


def _write(out: Any, ids: list[int], dtype: str) -> int:
    np.asarray(ids, dtype=dtype).tofile(out)
    return len(ids)


def byte_tokens(files: Sequence[str]) -> np.ndarray:
    """The bytes of the files' documents as tokens (vocabulary 256), concatenated."""
    parts = [np.frombuffer(doc.encode("utf-8"), dtype=np.uint8) for f in files for doc in iter_documents(f)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


@dataclass
class PackedData:
    """``tokens`` cut into consecutive ``seq_len`` sequences; the last ``num_eval`` sequences are held
    out, or, given ``eval_tokens``, those cut into sequences are the held-out ones and every sequence
    of ``tokens`` trains (``eval_fraction`` is then not used). Training visits the others in a fresh
    permutation every epoch, seeded by ``seed`` and the epoch, so the global batch of every step is
    fixed (an exactly resumable run) and data-parallel rank ``dp_rank`` reads rows
    ``[dp_rank * batch, (dp_rank + 1) * batch)`` of it."""

    tokens: np.ndarray
    seq_len: int
    batch: int
    dp_size: int
    dp_rank: int
    seed: int
    eval_fraction: float = 0.0
    eval_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        total = len(self.tokens) // self.seq_len
        if self.eval_tokens is not None:
            self.num_eval = len(self.eval_tokens) // self.seq_len
            self.num_train = total
        else:
            self.num_eval = 0 if self.eval_fraction <= 0 else max(1, int(total * self.eval_fraction))
            self.num_train = total - self.num_eval
        if self.num_train < self.batch * self.dp_size:
            raise ValueError(
                f"--data: {len(self.tokens)} tokens make {self.num_train} training sequences of --seq-len "
                f"{self.seq_len}, fewer than one global batch ({self.batch} x {self.dp_size} data-parallel ranks); "
                "give more text or a smaller --seq-len / --batch-size"
            )
        self._perm_epoch = -1
        self._perm = np.zeros(0, dtype=np.int64)

    def _sequence(self, index: int) -> torch.Tensor:
        source = self.tokens
        if self.eval_tokens is not None and index >= self.num_train:
            source, index = self.eval_tokens, index - self.num_train
        row = source[index * self.seq_len : (index + 1) * self.seq_len]
        return torch.from_numpy(np.asarray(row, dtype=np.int64))

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_train), epoch
        return self._perm

    def global_indices(self, micro_step: int) -> list[int]:
        """The training sequences of the ``micro_step``-th global micro-batch (all dp ranks)."""
        n = self.batch * self.dp_size
        out = []
        for k in range(micro_step * n, (micro_step + 1) * n):
            epoch, pos = divmod(k, self.num_train)
            out.append(int(self._order(epoch)[pos]))
        return out

    def train_batch(self, micro_step: int) -> torch.Tensor:
        """This rank's rows of the ``micro_step``-th global micro-batch, ``(batch, seq_len)``."""
        mine = self.global_indices(micro_step)[self.dp_rank * self.batch : (self.dp_rank + 1) * self.batch]
        return torch.stack([self._sequence(i) for i in mine])

    def eval_batches(self, max_sequences: int = 0) -> Iterator[torch.Tensor]:
        """This rank's share of the held-out sequences (round-robin over dp ranks), ``batch`` at a time;
        every rank yields the same number of batches (the last may be shorter), at most
        ``max_sequences`` sequences over all ranks when it is positive; the remainder that would
        leave ranks unequal is skipped."""
        count = self.num_eval if max_sequences <= 0 else min(self.num_eval, max_sequences)
        per_rank = count // self.dp_size
        mine = [self.num_train + i for i in range(self.dp_rank, per_rank * self.dp_size, self.dp_size)]
        for start in range(0, per_rank, self.batch):
            yield torch.stack([self._sequence(i) for i in mine[start : start + self.batch]])
