"""The recipes' default text: three public-domain books, installed from a registry package.

The Canterbury corpus (Arnold and Bell, 1997), the standard benchmark of text compression, holds
three Project Gutenberg books, and Google's ``brotli`` source distribution on PyPI ships them as
test data: Lewis Carroll's *Alice's Adventures in Wonderland* (1865), Shakespeare's *As You Like
It* (1623) and Milton's *Paradise Lost* (1667), all in the public domain; 0.76 MB of English.
``make setup`` runs this module once: it has pip fetch that one pinned archive (through the
machine's own index configuration; nothing is downloaded when a recipe runs), checks its SHA-256,
reads the three books out of it, and writes

* ``train.txt``: the first 95% of each book (cut at a line start), the books one after another;
* ``heldout.txt``: the last 5% of each, which the recipes evaluate on (``--eval-data``);
* ``SOURCE.json``: the archive, its hash, and each book's title and byte counts.

The Canterbury corpus' fourth text (``lcet10.txt``, workshop proceedings of 1992) is left out:
its contributors' rights are not as plain. Run ``python -m recipes.corpus`` to install it by hand;
it does nothing when the files are already there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIRECTORY = os.path.join(ROOT, "recipes", "data", "gutenberg")
TRAIN = os.path.join(DIRECTORY, "train.txt")
HELDOUT = os.path.join(DIRECTORY, "heldout.txt")

PACKAGE = "brotli"
VERSION = "1.2.1"
ARCHIVE = f"{PACKAGE}-{VERSION}.tar.gz"
SHA256 = "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de"
HELDOUT_SHARE = 0.05


@dataclass(frozen=True)
class Book:
    member: str
    title: str
    author: str
    year: int


BOOKS = (
    Book("alice29.txt", "Alice's Adventures in Wonderland", "Lewis Carroll", 1865),
    Book("asyoulik.txt", "As You Like It", "William Shakespeare", 1623),
    Book("plrabn12.txt", "Paradise Lost", "John Milton", 1667),
)


def missing_message() -> str:
    """The one line a recipe prints when the default text is not installed."""
    where = os.path.relpath(TRAIN, ROOT)
    return f"the default text {where} is not installed: run `make setup` or `python -m recipes.corpus`"


def installed(directory: str = DIRECTORY) -> bool:
    return all(os.path.exists(os.path.join(directory, f)) for f in ("train.txt", "heldout.txt", "SOURCE.json"))


def split(text: str, share: float = HELDOUT_SHARE) -> tuple[str, str]:
    """``text`` cut at the first line start at or after ``1 - share`` of its characters: (train,
    held-out); the held-out part is never empty for a text of more than one line."""
    cut = text.find("\n", max(0, int(len(text) * (1 - share)) - 1))
    if cut < 0 or cut + 1 >= len(text):
        cut = text.rfind("\n", 0, len(text) - 1)
    if cut < 0:
        raise ValueError(f"a text of {len(text)} characters has no line to hold out")
    return text[: cut + 1], text[cut + 1 :]


def download(into: str) -> str:
    """The pinned archive, fetched by pip into ``into``, its hash checked."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
    cmd += ["--quiet", "-d", into, f"{PACKAGE}=={VERSION}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    path = os.path.join(into, ARCHIVE)
    if done.returncode != 0 or not os.path.exists(path):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"pip could not fetch {PACKAGE}=={VERSION}'s source archive: {tail[0]}")
    digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{ARCHIVE}: SHA-256 {digest}, expected {SHA256}; the index serves another file")
    return path


def read_books(archive: str) -> dict[str, str]:
    """Each book's text from the archive, line ends normalised to ``\\n``."""
    out = {}
    with tarfile.open(archive, "r:gz") as tar:
        for book in BOOKS:
            member = tar.extractfile(f"{PACKAGE}-{VERSION}/tests/testdata/{book.member}")
            if member is None:
                raise SystemExit(f"{ARCHIVE} has no {book.member}")
            out[book.member] = member.read().decode("ascii").replace("\r\n", "\n")
    return out


def write(texts: dict[str, str], directory: str) -> dict[str, object]:
    """train.txt, heldout.txt and SOURCE.json in ``directory``, each written under a temporary name
    and renamed, so that a reader never sees a partial corpus."""
    os.makedirs(directory, exist_ok=True)
    trains, helds, books = [], [], []
    for book in BOOKS:
        train, held = split(texts[book.member])
        trains.append(train)
        helds.append(held)
        books.append({**book.__dict__, "train_bytes": len(train), "heldout_bytes": len(held)})
    source = {"package": f"{PACKAGE}=={VERSION}", "archive": ARCHIVE, "sha256": SHA256, "books": books}
    for name, body in (("train.txt", "\n".join(trains)), ("heldout.txt", "\n".join(helds))):
        tmp = os.path.join(directory, f".{name}.tmp")
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(body)
        os.replace(tmp, os.path.join(directory, name))
    tmp = os.path.join(directory, ".SOURCE.json.tmp")
    with open(tmp, "w") as f:
        json.dump(source, f, indent=1)
    os.replace(tmp, os.path.join(directory, "SOURCE.json"))
    return source


def install(directory: str = DIRECTORY, force: bool = False) -> bool:
    """Install the corpus into ``directory`` unless it is there (or ``force``); True when written."""
    if installed(directory) and not force:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        write(read_books(download(tmp)), directory)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=DIRECTORY, help="where to write train.txt and heldout.txt")
    ap.add_argument("--force", action="store_true", help="fetch and write again even when installed")
    args = ap.parse_args(argv)
    wrote = install(args.dir, args.force)
    sizes = ", ".join(f"{f} {os.path.getsize(os.path.join(args.dir, f))} bytes" for f in ("train.txt", "heldout.txt"))
    print(f"{'installed' if wrote else 'already installed'}: {args.dir} ({sizes})")


if __name__ == "__main__":
    main()
