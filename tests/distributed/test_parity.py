"""The parity grid (tests/helpers/parity.py) for every optimizer configuration in tests/helpers/cases.py."""

from __future__ import annotations

import pytest

from tests.helpers import parity
from tests.helpers.cases import PARITY_CASES, PRODUCTION_CASES


@pytest.mark.parametrize("case", PARITY_CASES, ids=[c.id for c in PARITY_CASES])
def test_parity_grid(pool4, case) -> None:
    results = pool4.run(parity.parity_worker, case.cls, case.kwargs)
    failures = sorted({f for rank_failures in results for f in rank_failures})
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", PRODUCTION_CASES, ids=[c.id for c in PRODUCTION_CASES])
def test_parity_production_blocks(pool4, case) -> None:
    """Factors of 300-576 (blocked kernels) on tp=2 x dp=2 x ZeRO and dp=4 x ZeRO, fp32 masters."""
    results = pool4.run(
        parity.parity_worker,
        case.cls,
        case.kwargs,
        parity.PRODUCTION_LAYOUTS,
        ("fp32",),
        parity.PRODUCTION_SPECS,
    )
    failures = sorted({f for rank_failures in results for f in rank_failures})
    assert not failures, "\n".join(failures)
