"""One initial preconditioner scale for the same-shape parameters of a param group
(``precond_init_scale_by_shape``, heavyball's ``multi_tensor=True``).

heavyball 3.2.1 stacks a param group's parameters of one shape (the parameter's own: a (1, 7) weight
is not stacked with a (7,) one; its ``BucketGuard``: shape, dtype, device) into one slab and steps
the slab, so the factors of those that start in the same step get one initial scale,
``mean(|g|^4)^(-1/8)`` of their raw gradients together (``precond_init_scale=None``); apart from
that scale and the order of its random probes, a stacked step is each member's own step
(``tests/unit/test_heavyball_psgd.py``). Here each rank sums ``|g|^4`` over the elements it holds of
each starting parameter, one :class:`~dist_optim.comm.SumBucket` flush adds them over the
parameters' sum groups (ZeRO, then TP), and the owners start their factors from their bucket's
scale. The flush happens only in a step where some such parameter starts: at most one all-reduce per
process group, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..comm import SumBucket
from ..layout import ParamLayout
from .preconditioner import initial_scale, moment_scale

__all__ = ["shared_initial_scales"]


def shared_initial_scales(
    starting: Sequence[tuple[dict[str, Any], torch.Tensor, torch.Tensor, ParamLayout]],
) -> dict[torch.Tensor, float]:
    """The initial scale of every parameter in ``starting`` (group, parameter, this rank's raw
    gradient, layout: the parameters that take their first step now) whose group shares scales by
    shape (``precond_init_scale_by_shape`` with ``precond_init_scale=None``), by parameter.
    Collective over the parameters' sum groups when any of them shares."""
    bucket = SumBucket()
    queued = []
    for group, p, g, layout in starting:
        if group.get("precond_init_scale_by_shape", False) and group["precond_init_scale"] is None:
            local = g.detach().double().abs().pow(4).sum().reshape(1)  # ZeRO padding adds zeros
            bucket_key = (id(group), tuple(layout.full_shape), p.dtype)
            queued.append((bucket_key, group, p, layout.full_numel, bucket.add(local, layout.sum_groups)))
    if not queued:
        return {}
    bucket.flush()
    sums = torch.cat([s for *_, s in queued]).tolist()  # one host read for all of them
    totals: dict[tuple[int, tuple[int, ...], torch.dtype], list[float]] = {}
    for (bucket_key, _, _, numel, _), total in zip(queued, sums):
        acc = totals.setdefault(bucket_key, [0.0, 0.0])
        acc[0] += total
        acc[1] += numel
    scales = {}
    for bucket_key, group, p, _, _ in queued:
        total, count = totals[bucket_key]
        scales[p] = initial_scale(group, moment_scale(total / count if count else 0.0))
    return scales
