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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, cast

__all__ = ["replayable", "replaying", "Replayer"]

F = TypeVar("F", bound=Callable[..., Any])

#: ``replayer(fn, args, kwargs)`` computes or replays ``fn(*args, **kwargs)``.
Replayer = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

_replayer: Replayer | None = None


def replayable(fn: F) -> F:
    """Mark ``fn`` as replayable by a simulator (see the module docstring)."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _replayer is None:
            return fn(*args, **kwargs)
        return _replayer(fn, args, kwargs)

    return cast(F, call)


@contextmanager
def replaying(replayer: Replayer) -> Iterator[None]:
    """Route the calls of :func:`replayable` functions through ``replayer`` inside the block."""
    global _replayer
    previous, _replayer = _replayer, replayer
    try:
        yield
    finally:
        _replayer = previous
