"""An owner's work on its blocks at one step, in batches (step 3-5 of the package docstring).

The optimizer lists the blocks whose directions this rank computes (:class:`BlockWork`: held
whole, owned of a gathered parameter, or owned of a routed one); :func:`run` cuts the list into
batches of one param group and step, reads their typed states, has
:func:`.preconditioner.block_directions` compute a batch at once, and, for a parameter held
whole by this rank alone, applies the batch's directions before the next batch reuses their
scratch memory. A batch holds at most ``budget`` bytes of gradients (the step-memory budget,
:mod:`dist_optim.sharding.budget`), so its directions' scratch stays within it too.

A batch is in-place work on its blocks' state, gradients, outputs and parameters, and a model's
layers give batches of the same shapes again and again: each batch goes through
:func:`~dist_optim.kernels.replay.replayable_work` with what it reads (:func:`describe`), so that a
simulator (the planner) can replay a batch it has seen instead of dispatching its operators again.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.replay import replayable_work
from ..states import bnb
from .blocking import Block
from .preconditioner import Job, block_directions
from .state import BlockState, Scratch, block_prefix, step_state
from .update import apply_updates

__all__ = ["BlockWork", "batches", "run", "describe"]


@dataclass
class BlockWork:
    """Block ``index`` of a parameter (``state``: its optimizer state, ``group``: its param group,
    ``t``: its step) with gradient ``g``. Its direction goes into ``out``, or, when ``out`` is
    None, into scratch memory, and is then applied to ``param``, the block of the parameter held
    whole, with ``buf``, the block of its momentum buffer (:func:`.update.whole_views`)."""

    state: dict[str, Any]
    index: int
    block: Block
    g: torch.Tensor
    group: dict[str, Any]
    t: int
    out: torch.Tensor | None = None
    param: torch.Tensor | None = None
    buf: torch.Tensor | None = None


def batches(works: list[BlockWork], budget: int | None) -> Iterator[list[BlockWork]]:
    """Runs of consecutive ``works`` of one param group and step, gradient dtype and device,
    each of at most ``budget`` bytes of gradients (a larger block alone; None: no limit)."""
    batch: list[BlockWork] = []
    size = 0
    for w in works:
        nbytes = w.g.numel() * w.g.element_size()
        if batch:
            first = batch[0]
            same = first.group is w.group and first.t == w.t and first.g.dtype == w.g.dtype
            if not same or first.g.device != w.g.device or (budget is not None and size + nbytes > budget):
                yield batch
                batch, size = [], 0
        batch.append(w)
        size += nbytes
    if batch:
        yield batch


def run(works: list[BlockWork], scratch: Scratch, budget: int | None) -> None:
    """Each work's direction, batch by batch (:func:`batches`): into its ``out``, or, without one,
    applied to its ``param`` before the next batch reuses the scratch it was computed in (by the
    fused kernel already where :func:`.preconditioner.block_directions` could)."""
    for batch in batches(works, budget):
        replayable_work(functools.partial(_run_batch, batch, scratch), functools.partial(describe, batch, scratch))


def describe(batch: list[BlockWork], scratch: Scratch) -> tuple[Any, ...]:
    """What a batch's step reads (:func:`~dist_optim.kernels.replay.replayable_work`): the scratch it
    reuses (by identity: it only grows), the step, the group's options, and per block which block
    before it shares its parameter's state, its shape and whether it is preconditioned (not where it
    is: the math is the same), its step counter, its state's tensors, gradient, output, parameter and
    momentum buffer."""
    first = batch[0]
    shared: dict[int, int] = {}
    blocks = [
        (
            shared.setdefault(id(w.state), i),
            w.block.shape,
            w.block.precondition,
            w.state["step"],
            BlockState.of(w.state, block_prefix(w.index), w.block.order).flat(""),
            (w.g, w.out, w.param, w.buf),
        )
        for i, w in enumerate(batch)
    ]
    return (id(scratch), first.t, {k: v for k, v in first.group.items() if k != "params"}, blocks)


def _run_batch(batch: list[BlockWork], scratch: Scratch) -> None:
    """One batch's directions (:func:`run`)."""
    first = batch[0]
    spare = [w for w in batch if w.out is None]
    outs = iter(scratch.split([w.block.shape for w in spare], first.g.dtype, first.g.device, "outs"))
    eight = bnb.Batch8bit()  # the blocks' 8-bit moments: whole on their owner, no collective
    jobs = []
    for w in batch:
        bs = step_state(w.state, block_prefix(w.index), w.block, w.group, w.g.dtype, eight)
        out = w.out if w.out is not None else next(outs)
        # the fused kernel may update the parameter itself where no momentum buffer needs the direction
        jobs.append(Job(bs, w.block, w.g, w.state["step"], out, w.param if w.buf is None else None))
    directions = block_directions(jobs, first.group, first.t, scratch)
    eight.store()
    ps: list[torch.Tensor] = []
    ds: list[torch.Tensor] = []
    bufs: list[torch.Tensor | None] = []
    for w, d in zip(batch, directions):
        if w.out is None and d is not None:
            assert w.param is not None
            ps.append(w.param)
            ds.append(d)
            bufs.append(w.buf)
        else:  # an owner's direction is always its out (None: a seeding step, nothing to apply)
            assert d is None or d is w.out or w.out is None
    apply_updates(ps, ds, bufs, first.group)
