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


#: Same-shape parameters cut alike and otherwise (TP-split pairs on either dim, a replicated third
#: (8, 6), padded chunks, 3-D, vectors), so that a scale shared by shape spans pieces on other ranks.
SHARED_SCALE_SPECS = [
    parity.Spec("col", (8, 6), 0),
    parity.Spec("col2", (8, 6), 0),
    parity.Spec("colrep", (8, 6), None),
    parity.Spec("row", (6, 8), -1),  # no gradient at parity.NONE_GRAD_STEP
    parity.Spec("row2", (6, 8), -1),
    parity.Spec("padsplit", (6, 5), 0),
    parity.Spec("padsplit2", (6, 5), 0),
    parity.Spec("conv", (3, 4, 3), 1),
    parity.Spec("conv2", (3, 4, 3), 1),
    parity.Spec("norm", (6,), None),
    parity.Spec("norm2", (6,), None),
]


def test_parity_initial_scales_shared_by_shape(pool4) -> None:
    """heavyball's PSGDKron defaults (``precond_init_scale_by_shape``, dist_optim/kron/init_scale.py):
    same-shape parameters start from one scale of their gradients together, on every layout."""
    (case,) = [c for c in PARITY_CASES if c.id == "kron-heavyball"]
    kwargs = dict(case.kwargs, precond_init_scale_by_shape=True)
    results = pool4.run(parity.parity_worker, case.cls, kwargs, None, ("fp32", "bf16"), SHARED_SCALE_SPECS)
    failures = sorted({f for rank_failures in results for f in rank_failures})
    assert not failures, "\n".join(failures)
