"""The README's support table is exactly what the tests cover (regenerate: python -m tests.support)."""

from __future__ import annotations

import os

from tests.support import markdown

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_support_table_is_generated_from_the_tests() -> None:
    with open(README) as f:
        text = f.read()
    assert markdown() in text, "README.md's support table is stale: paste the output of `python -m tests.support`"
