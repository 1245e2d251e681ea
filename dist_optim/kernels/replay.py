"""A hook for simulators: pure functions of whole tensors that a simulated step may replay.

The planner (:mod:`dist_optim.plan`) runs the optimizers' own step on meta tensors and measures
what it allocates. A model repeats the same shapes (a Llama's 80 decoder layers hold the same
seven matrices), so the same pure functions (a Newton-Schulz iteration, a root inverse, a
triangular product) run thousands of times on identical metadata, with identical effects on the
memory measured. A function marked :func:`replayable` goes through the simulator's replayer
when one is installed (:func:`replaying`): it may compute the first call and replay the recorded
effects for the next ones. Outside a simulation the mark costs one global read per call.

A replayable function must be pure on its tensors' metadata: its outputs' shapes, dtypes and
aliasing and the memory it allocates depend only on its arguments' metadata and values that are
not tensors, and it issues no collective.

Work done in place on state goes through :func:`replayable_work` instead: an owner's step on a
batch of blocks (Shampoo's :mod:`dist_optim.shampoo.work`) writes into tensors it is handed and
returns nothing, and a model's blocks come in batches of the same shapes, layer after layer. The
caller describes what the work reads; a simulator may replay the recorded effect of an earlier
batch with the same description.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

__all__ = ["replayable", "replayable_work", "replaying", "replaying_work", "Replayer", "WorkReplayer"]

F = TypeVar("F", bound=Callable[..., Any])

#: ``replayer(fn, args, kwargs)`` computes or replays ``fn(*args, **kwargs)``.
Replayer = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

_replayer: Replayer | None = None

#: ``work_replayer(fn, describe)`` runs ``fn()`` or replays the effect of an earlier call with the same
#: ``describe()`` (:func:`replayable_work`).
WorkReplayer = Callable[[Callable[[], None], Callable[[], Any]], None]

_work_replayer: WorkReplayer | None = None


def replayable(fn: F) -> F:
    """Mark ``fn`` as replayable by a simulator (see the module docstring)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _replayer is None:
            return fn(*args, **kwargs)
        return _replayer(fn, args, kwargs)

    return cast(F, call)


def replayable_work(fn: Callable[[], None], describe: Callable[[], Any]) -> None:
    """Run ``fn()``, work done in place on tensors, or hand it to the simulator's work replayer where
    one is installed (:func:`replaying_work`). ``describe()`` (called only by a simulator) is what ``fn``
    reads: its tensors (whose metadata, aliasing and followed values it may depend on), and the
    numbers, strings and options that steer it, nested in tuples, lists and dicts. ``fn`` must
    write only into the described tensors, in place, keep no memory it allocates, replace none of
    them (``describe()`` after it names the same tensors) and issue no collective; the simulator
    runs a call again where it sees otherwise. Outside a simulation it costs one global read."""
    if _work_replayer is None:
        fn()
    else:
        _work_replayer(fn, describe)


@contextmanager
def replaying(replayer: Replayer) -> Iterator[None]:
    """Route the calls of :func:`replayable` functions through ``replayer`` inside the block."""
    global _replayer
    previous, _replayer = _replayer, replayer
    try:
        yield
    finally:
        _replayer = previous


@contextmanager
def replaying_work(work: WorkReplayer) -> Iterator[None]:
    """Route the calls of :func:`replayable_work` through ``work`` inside the block."""
    global _work_replayer
    previous, _work_replayer = _work_replayer, work
    try:
        yield
    finally:
        _work_replayer = previous
