"""The step-memory budget (``bucket_bytes``, dist_optim/sharding/budget.py) of the optimizers that move work
to owners: Shampoo (and SOAP), Muon and Kron.

Whatever the budget, the result is the same bit for bit (parameters and full state after the
parity grid's steps, a None gradient among them) on TP x ZeRO, ZeRO alone and plain data
parallelism; the collectives per step (counted at torch.distributed, tests/helpers/collectives.py)
grow with the number of buckets and only with it: at most one whole step's set per bucket.
LAMB's budget is tested in tests/unit/test_lamb.py, GaLore's in tests/unit/test_galore.py.
"""

from __future__ import annotations

import collections
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import dist_optim
from dist_optim.sharding.budget import DEFAULT_BUCKET_BYTES, buckets, check_bucket_bytes
from tests.helpers import parity
from tests.helpers.cases import PARITY_CASES

CASES = ["shampoo-adam-eigh-blocks-pf2", "shampoo-soap-qr", "muon", "normuon", "kron"]
LAYOUTS = [(2, 2, 1), (1, 4, 1), (1, 4, 0)]
#: None: one bucket per step; 1: every parameter its own bucket, each exchanged in as many rounds as
#: its work group has ranks; 300: a few parameters per bucket, the larger ones in rounds; "whole":
#: twice the largest parameter's fp32 bytes (Kron moves momentum and gradient), so no exchange
#: needs rounds, and several buckets run.
BUDGETS: list[int | str | None] = [None, 1, 300, "whole"]
#: Issued once per step whatever the budget (the NaN/Inf flag) or once per run (route planning).
FIXED = ("all_reduce", "all_gather_object")


def _run(case_id: str, layout: tuple[int, int, int], budget: int | None) -> tuple[Any, ...]:
    from tests.helpers.collectives import counting_collectives

    case = next(c for c in PARITY_CASES if c.id == case_id)
    opt, masters, _, local_grad = parity.build(case.cls, dict(case.kwargs, bucket_bytes=budget), *layout, "fp32")
    with_grads = 0
    with counting_collectives() as seen:
        for step in range(parity.STEPS):
            parity.set_grads(masters, step, local_grad)
            with_grads += sum(p.grad is not None for p in masters)
            opt.step()
    params, states = parity.full_result(opt, masters)
    return params, states, collections.Counter(seen.counts), with_grads


def _identical(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    params_a, states_a = a[:2]
    params_b, states_b = b[:2]
    return all(torch.equal(x, y) for x, y in zip(params_a, params_b)) and all(
        set(s) == set(t) and all(torch.equal(torch.as_tensor(s[k]), torch.as_tensor(t[k])) for k in s)
        for s, t in zip(states_a, states_b)
    )


def _budget_worker(case_id: str) -> list[str]:
    failures = []
    largest = 2 * 4 * max(t.numel() for t in parity.full_params("fp32"))
    for layout in LAYOUTS:
        runs = {budget: _run(case_id, layout, largest if budget == "whole" else budget) for budget in BUDGETS}
        whole = runs[None]
        moving = sum(n for op, n in whole[2].items() if op not in FIXED)
        per_step = moving / parity.STEPS
        for budget in BUDGETS[1:]:
            run = runs[budget]
            # An exchange of tensors over the budget runs in up to one round per rank of its work
            # group (4 here); within the budget, in one.
            rounds = 1 if budget == "whole" else 4
            if not _identical(run, whole):
                failures.append(f"{case_id} {layout} bucket_bytes={budget}: result differs from one bucket")
            for op in FIXED:
                if run[2][op] != whole[2][op]:
                    failures.append(f"{case_id} {layout} bucket_bytes={budget}: {op} {run[2][op]} != {whole[2][op]}")
            moved = sum(n for op, n in run[2].items() if op not in FIXED)
            # at most one whole step's collectives per bucket (a parameter with a gradient each, at
            # most), times the rounds
            if moved > per_step * run[3] * rounds:
                failures.append(
                    f"{case_id} {layout} budget {budget}: {moved} > {per_step} x {run[3]} x {rounds} collectives"
                )
            if budget == 1 and per_step and moved <= moving:
                failures.append(f"{case_id} {layout}: one parameter per bucket issued {moved} <= {moving} collectives")
    return failures


@pytest.mark.parametrize("case_id", CASES)
def test_any_budget_gives_the_same_step(pool4, case_id: str) -> None:
    failures = [f for res in pool4.run(_budget_worker, case_id) for f in res]
    assert not failures, "\n".join(failures[:10])


def test_buckets_are_consecutive_and_within_the_budget() -> None:
    sizes = [5, 3, 9, 1, 1, 20, 2]
    assert list(buckets(sizes, None)) == [(0, 7)]
    assert list(buckets(sizes, 8)) == [(0, 2), (2, 3), (3, 5), (5, 6), (6, 7)]  # 9 and 20 alone
    assert list(buckets(sizes, 1)) == [(i, i + 1) for i in range(7)]
    assert list(buckets([], 8)) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda p, b: dist_optim.DistributedShampoo(p, bucket_bytes=b),
        lambda p, b: dist_optim.DistributedMuon(p, bucket_bytes=b),
        lambda p, b: dist_optim.DistributedNorMuon(p, bucket_bytes=b),
        lambda p, b: dist_optim.DistributedKron(p, bucket_bytes=b),
    ],
    ids=["shampoo", "muon", "normuon", "kron"],
)
def test_bad_budgets_are_refused(make: Any) -> None:
    for bad in (0, -5, 1.5, True, "1GB"):
        with pytest.raises(ValueError, match=f"bucket_bytes={bad!r}: expected a positive int"):
            make([nn.Parameter(torch.zeros(3, 2))], bad)
    assert make([nn.Parameter(torch.zeros(3, 2))], None).bucket_bytes is None
    assert make([nn.Parameter(torch.zeros(3, 2))], DEFAULT_BUCKET_BYTES).bucket_bytes == DEFAULT_BUCKET_BYTES
    assert check_bucket_bytes(7) == 7


def test_shampoo_max_gather_bytes_is_the_old_name() -> None:
    with pytest.warns(FutureWarning, match="max_gather_bytes=4096 is the old name of bucket_bytes"):
        opt = dist_optim.DistributedShampoo([nn.Parameter(torch.zeros(3, 2))], max_gather_bytes=4096)
    assert opt.bucket_bytes == 4096
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dist_optim.DistributedShampoo([nn.Parameter(torch.zeros(3, 2))]).bucket_bytes == DEFAULT_BUCKET_BYTES
