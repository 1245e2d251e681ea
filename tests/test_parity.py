"""Parity grid (DESIGN.md §4) for every optimizer configuration in tests/cases.py."""

from __future__ import annotations

import pytest

from tests import parity
from tests.cases import PARITY_CASES


@pytest.mark.parametrize("case", PARITY_CASES, ids=[c.id for c in PARITY_CASES])
def test_parity_grid(pool4, case) -> None:
    results = pool4.run(parity.parity_worker, case.cls, case.kwargs)
    failures = sorted({f for rank_failures in results for f in rank_failures})
    assert not failures, "\n".join(failures)
