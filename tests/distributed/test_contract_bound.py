"""torch.optim's copy contract for bound optimizers (tests/unit/test_contract.py has the unbound one):
``copy.deepcopy`` of an optimizer bound at tp=2 x ZeRO over dp=2 is an optimizer that steps exactly
as the original on the same layout, sharing its process groups; pickling one is refused in one line
(process groups do not pickle), naming what to do instead."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch

from tests.helpers.cases import PARITY_CASES
from tests.helpers.check import differences
from tests.helpers.parity import build, set_grads

#: The first parity case of each optimizer class.
FIRST = {c.cls.__name__: c for c in reversed(PARITY_CASES)}


def copied_and_stepped(case_id: str) -> dict[str, Any]:
    case = next(c for c in PARITY_CASES if c.id == case_id)
    opt, masters, _, local_grad = build(case.cls, case.kwargs, 2, 2, 1, "fp32")
    for step in range(3):
        set_grads(masters, step, local_grad)
        opt.step()
    clone = copy.deepcopy(opt)
    order = [next(i for i, q in enumerate(p for g in opt.param_groups for p in g["params"]) if q is m) for m in masters]
    mirrored = [[p for g in clone.param_groups for p in g["params"]][i] for i in order]
    out: dict[str, Any] = {"groups_shared": clone.dp_group is opt.dp_group and clone.tp_group is opt.tp_group}
    for step in range(3, 6):  # step 3 has a None gradient
        for o, ps in ((opt, masters), (clone, mirrored)):
            set_grads(ps, step, local_grad)
            o.step()
    out["params"] = [i for i, (a, b) in enumerate(zip(masters, mirrored)) if not torch.equal(a, b)]
    out["state"] = differences(clone.full_state(), opt.full_state())
    try:
        pickle.dumps(opt)
        out["pickle"] = "no error"
    except TypeError as e:
        out["pickle"] = str(e)
    return out


@pytest.mark.parametrize("case_id", [c.id for c in FIRST.values()])
def test_a_deepcopy_of_a_bound_optimizer_steps_as_the_original(case_id: str, pool4) -> None:
    for rank, res in enumerate(pool4.run(copied_and_stepped, case_id)):
        assert res["groups_shared"], f"rank {rank}: the copy has other process groups"
        assert not res["params"], f"rank {rank}: params {res['params']} differ after the copy's steps"
        assert res["state"] == [], f"rank {rank}: {res['state'][:5]}"
        assert "cannot pickle a bound" in res["pickle"] and "state_dict()" in res["pickle"], res["pickle"]
