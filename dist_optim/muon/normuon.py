"""NorMuon: Muon whose orthogonalized update is normalized neuron by neuron (Z. Li et al., 2025,
"NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491; the authors' code:
github.com/zichongli5/NorMuon, ``normuon.py``).

Muon's update ``X`` of an ``m x n`` matrix (:mod:`dist_optim.muon`) has singular values near 1 but
rows (output neurons) of very different norms. NorMuon keeps a second moment per row and divides
by it, as Adam does per element, then restores ``X``'s Frobenius norm so that the step size and
its lr adjustment are Muon's::

    X = Muon's orthogonalized C                      (m x n)
    v <- beta2 v + (1 - beta2) mean_j X_ij^2          (m,)   the neuron-wise second moment
    U  = X / (sqrt(v) + eps)                          row i divided by its sqrt(v_i) + eps
    U <- U ||X||_F / (||U||_F + eps)
    W <- W (1 - lr * weight_decay) - lr' U            lr' of ``adjust_lr_fn``, as Muon's

This is the authors' ``normuon_update`` (their ``1e-10`` is ``normalization_eps``). The paper's
Algorithm 1 instead scales ``U`` to ``0.2 sqrt(mn) / ||U||_F`` (an RMS of 0.2, AdamW's): with
``adjust_lr_fn="match_rms_adamw"`` the steps differ only by ``||X||_F``, which Newton-Schulz holds
near ``sqrt(min(m, n))``.

Deviations: the normalization runs in float32 (float64 for float64 parameters) and ``v`` is kept
in that dtype, then ``U`` is rounded to the iteration's dtype; the authors' code normalizes in the
iteration's bfloat16 and keeps ``v`` in the parameter's dtype (with float32 parameters their
``lerp_`` of a bfloat16 mean into a float32 ``v`` is refused by torch). A parameter without a
gradient is skipped, as Muon's (the authors' code steps it with a zero gradient). Each of the
matrices of ``stacked`` or ``heads`` has its own rows' ``v``, as the authors' batched 3-D update
does for a stack.

Distribution: ``U`` needs whole rows of ``X`` and the norm of the whole matrix, which only the
matrix's owner has (it orthogonalized it), so the owner normalizes and keeps that matrix's rows of
``v``: nothing travels beyond Muon's exchanges, and ``v`` is held once in the job, not per rank.
What one rank holds: for each parameter of which it owns a matrix, ``v`` of the tensor its task
sees (the parameter; its TP slice where whole heads are local), of which it reads and writes only
its matrices' rows. :meth:`DistributedNorMuon.full_state` assembles every row from its owner;
:meth:`~dist_optim.base.DistOptimizer.load_full_state` gives each owner its rows of any layout.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..base import check_range
from ..comm import gather_full
from ..kernels.dtypes import accumulation_dtype
from ..layout import Box, ParamLayout, TPSplit
from ..sharding.owners import Owner, Task, share_results
from ..sharding.runtime import OwnedWork
from .optimizer import DistributedMuon, is_stacked

__all__ = ["DistributedNorMuon", "normalize_neurons", "NEURON_STATE"]

#: The state key of the neuron-wise second moment (the authors' ``second_momentum_buffer``).
NEURON_STATE = "neuron_second_moment"


def normalize_neurons(x: torch.Tensor, v: torch.Tensor, beta2: float, eps: float) -> torch.Tensor:
    """NorMuon's update of one ``rows x cols`` orthogonalized matrix ``x``, updating its rows'
    second moment ``v`` (``rows``, the state's dtype: the computation's) in place. Pure math on
    local tensors; the result is in ``v``'s dtype."""
    xf = x.to(v.dtype)
    norm = torch.linalg.vector_norm(xf)
    v.lerp_(xf.square().mean(dim=-1), 1 - beta2)
    u = xf * (1 / (v.sqrt() + eps)).unsqueeze(-1)
    return u.mul_(norm / (torch.linalg.vector_norm(u) + eps))


def rows_shape(view: tuple[int, ...], group: dict[str, Any]) -> tuple[int, ...]:
    """The shape of ``v`` for a tensor seen as ``view``: one entry per row of each of its matrices
    (``view[0]`` rows; ``stacked``: ``view[0] x view[1]``)."""
    return tuple(view[:2]) if is_stacked(view, group) else tuple(view[:1])


def moment_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype ``v`` is kept and computed in: float32, float64 beside float64 parameters."""
    return accumulation_dtype(param.dtype)


def _zero_moment(param: torch.Tensor, group: dict[str, Any], task: Task) -> torch.Tensor:
    """A fresh ``v`` for the tensor ``task`` sees (:func:`rows_shape`)."""
    return torch.zeros(rows_shape(task.view, group), dtype=moment_dtype(param), device=param.device)


def _rows_of(box: Box) -> slice:
    """The entries of ``v`` a box's matrices use: its first dim's range (a stack's slices, a
    matrix's rows or a head's)."""
    return slice(box[0][0], box[0][1])


class DistributedNorMuon(DistributedMuon):
    """NorMuon with an auxiliary AdamW, exact under tensor parallelism and ZeRO (module docstring).

    Every argument of :class:`~dist_optim.muon.DistributedMuon`, with the same defaults, and:

    Args:
        beta2: decay of the neuron-wise second moment, in [0, 1) (the authors' default 0.95).
        normalization_eps: added to ``sqrt(v)`` and to ``||U||_F`` (> 0; the authors' 1e-10).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        *,
        beta2: float = 0.95,
        normalization_eps: float = 1e-10,
        **options: Any,
    ) -> None:
        self._normuon = dict(beta2=beta2, normalization_eps=normalization_eps)
        super().__init__(params, lr, weight_decay, momentum, nesterov, **options)

    def _variant_defaults(self) -> dict[str, Any]:
        return dict(self._normuon)

    def validate_group(self, group: dict[str, Any]) -> None:
        super().validate_group(group)
        if group.get("use_muon", True):
            check_range("beta2", group["beta2"], 0.0, 1.0)
            check_range("normalization_eps", group["normalization_eps"], 0.0, open_low=True)

    # ---- the owner's normalization -------------------------------------------------------------
    def _finish_owned(self, work: OwnedWork[Any], box: int | None, x: torch.Tensor) -> torch.Tensor:
        """Normalize the owned box's matrices (``box`` None: every box of the whole tensor), in
        ``x``'s dtype, with this rank's ``v`` of the parameter."""
        group, p = work.entry
        task = work.task
        v = self._neuron_state(p, group, task)
        for i in range(len(task.boxes)) if box is None else [box]:
            view = x[work.box_slices(i)] if box is None else x
            rows = v[_rows_of(task.boxes[i])].reshape(-1)
            u = normalize_neurons(view.reshape(rows.numel(), -1), rows, group["beta2"], group["normalization_eps"])
            view.copy_(u.view_as(view))
        return x

    def _neuron_state(self, p: torch.Tensor, group: dict[str, Any], task: Task) -> torch.Tensor:
        state = self.state[p]
        if NEURON_STATE not in state:
            state[NEURON_STATE] = _zero_moment(p, group, task)
        return state[NEURON_STATE]

    # ---- state in full form ---------------------------------------------------------------------
    def _tp_rows(self, p: torch.Tensor, task: Task, group: dict[str, Any]) -> ParamLayout | None:
        """Where the task sees this rank's TP slice (whole heads local), the layout of ``v`` over
        the TP group (its rows split as the parameter's); None where it sees the whole tensor."""
        layout = self.layout(p)
        if task.layout.full_shape == layout.full_shape or layout.tp is None:
            return None
        tp = layout.tp
        return ParamLayout(rows_shape(layout.full_shape, group), TPSplit(0, tp.size, tp.rank, tp.group))

    def full_state(self) -> list[dict[str, Any]]:
        """The base's full form, with each Muon parameter's ``v`` whole on every rank: every
        matrix's rows from its owner (one all-gather per work group), then over TP where each TP
        slice had its own heads. Collective when bound."""
        out = super().full_state()
        tasks = self._ensure_tasks() if self._muon_params() else {}
        shares: list[tuple[Owner, list[torch.Tensor]]] = []
        fulls: list[tuple[int, torch.Tensor, ParamLayout | None]] = []
        for i, (p, group) in enumerate((p, g) for g in self.param_groups for p in g["params"]):
            if not group["use_muon"] or not self.state.get(p):
                continue
            task = tasks[p]
            mine = self.state[p].get(NEURON_STATE)  # on the owners of its matrices
            v = _zero_moment(p, group, task) if mine is None else mine.clone()
            shares += [(task.owner(b), [v[_rows_of(box)]]) for b, box in enumerate(task.boxes)]
            fulls.append((i, v, self._tp_rows(p, task, group)))
        share_results(shares)
        split = [(layout, v) for _, v, layout in fulls if layout is not None]
        gathered = iter(gather_full(split))
        for i, v, layout in fulls:
            out[i][NEURON_STATE] = v if layout is None else next(gathered)
        return out

    def _localize_state(self, param: torch.Tensor, state: dict[str, Any]) -> dict[str, Any]:
        """For ``load_full_state``: the owners of the parameter's matrices keep ``v`` (the rows of
        their TP slice where it has its own heads), checked against the full shape on every rank."""
        v = state.get(NEURON_STATE)
        if v is None:
            return state
        group = self.group_of(param)
        want = rows_shape(self.layout(param).full_shape, group)
        if tuple(v.shape) != want or not v.is_floating_point():
            raise ValueError(
                f"load_full_state: {self.param_label(param)} has {NEURON_STATE} of shape {tuple(v.shape)} "
                f"({v.dtype}), its group needs a floating tensor of shape {want} (one entry per matrix row): "
                "load a state saved with the same stacked option"
            )
        task = self._ensure_tasks()[param]
        if not task.owned:
            return {k: x for k, x in state.items() if k != NEURON_STATE}
        layout = self._tp_rows(param, task, group)
        local = v if layout is None else layout.take_local(v)
        return {**state, NEURON_STATE: local.to(device=param.device, dtype=moment_dtype(param)).clone()}

    def keeps_saved_dtype(self, key: str, value: torch.Tensor) -> bool:
        """``v`` keeps its float32/float64 on load (torch's loader would cast it to bf16 parameters')."""
        return key == NEURON_STATE or super().keeps_saved_dtype(key, value)
