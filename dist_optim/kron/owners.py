"""Who owns each Kron parameter: Kron's tasks for the owner runtime (:mod:`dist_optim.sharding.runtime`).

* :func:`plan_param_owners`: one owner per parameter (one box: the whole tensor, in :func:`task_view`)
  in its work group, balancing :func:`~dist_optim.kron.structure.precond_cost`
  (:meth:`dist_optim.sharding.runtime.OwnerRuntime.plan`);
* :class:`KronParam`: a parameter's record in a step, whose :meth:`KronParam.fit_inputs` are the tensors
  its owner needs whole. How they reach the owner (routed pieces, or gathered whole where no
  route exists) and how the directions come back is the runtime's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import Box, ParamLayout
from ..sharding.owners import Task
from ..sharding.runtime import OwnerRuntime

__all__ = ["KronParam", "task_view", "plan_param_owners"]


@dataclass(eq=False)
class KronParam:
    """One parameter's step: its group, the parameter, its updated momentum ``m`` and gradient
    ``g`` (local pieces) and layout."""

    group: dict[str, Any]
    p: torch.Tensor
    m: torch.Tensor
    g: torch.Tensor
    layout: ParamLayout
    #: ``m`` is a copy the owner may overwrite (an 8-bit momentum's fp32 value), not the state's.
    scratch: bool = False

    def fit_inputs(self) -> list[torch.Tensor]:
        """The tensors the owner needs whole: the momentum, and the gradient where the
        preconditioner is fitted to it."""
        return [self.m] if self.group["momentum_into_precond_update"] else [self.m, self.g]


def task_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a parameter's owner task views it in (the runtime routes or gathers it in that
    shape): its full shape, a scalar as one element."""
    return tuple(shape) or (1,)


def _whole_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def plan_param_owners(
    owners: OwnerRuntime, params: Sequence[torch.Tensor], layouts: Sequence[ParamLayout], costs: Sequence[float]
) -> dict[torch.Tensor, Task]:
    """Every parameter's owner task in its work group, by cost, planned by ``owners``. Pure."""
    views = [task_view(layout.full_shape) for layout in layouts]
    specs = [(layout, view, [_whole_box(view)], [cost]) for layout, view, cost in zip(layouts, views, costs)]
    return dict(zip(params, owners.plan(params, specs)))
