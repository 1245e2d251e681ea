"""Every collective dist_optim issues goes through this package.

Optimizers do their math on local tensors and hand the cross-process parts to a few layout-aware,
*bucketed* operations (:mod:`.collectives`, the one module that calls them):

* :class:`SumBucket`: queue tensors whose values are partial sums over a parameter's shards (sums of
  squares for norms, row/column bins for factored statistics), then ``flush()`` once: one
  ``all_reduce`` per process group for the whole step, not one per parameter.
* :func:`gather_full`: local pieces (TP slices, ZeRO chunks) back into full tensors, one
  ``all_gather`` per group for all the tensors of a call.
* :func:`broadcast_from`: bucketed broadcast of results computed by one owner rank.
* :func:`share_owned`: results computed by different owner ranks, to every rank, in one ``all_gather``.
* :func:`exchange`: pieces from each rank to the ranks that need them (gradient pieces to the owners
  of blocks, the owners' results back), in one ``all_to_all``: each rank receives what it uses.
* :func:`reduce_scatter` / :func:`all_gather_chunks`: sums split into equal chunks, one per rank, and
  back to whole tensors; one collective each per call. The sum is made in rank order on the chunk's
  rank: its value does not depend on the other tensors of the call (nor on buckets).

Each is a no-op for a parameter whose layout is local. ``COUNTS`` counts the collectives issued
(tests and benchmarks: the number per step does not grow with the number of parameters).

Ordering: a process takes part in several groups (its TP group, its ZeRO group, ...). Buckets are
flushed group by group in one global order (the sorted member ranks of each group), which every
process follows, so collectives on overlapping groups cannot deadlock.

The package's other modules hold what the collectives need to know about groups: :mod:`.groups`
(sizes, ranks and members cached, the one order of groups, their lifetime), :mod:`.grids` (the
TP x DP grids made once per job) and :mod:`.rules` (NCCL's rules on each collective's tensors, and
the staging of host tensors, ZeRO's CPU-offloaded masters, through the group's device).
:func:`collectives_through` is the one hook by which code outside observes or replaces the calls
to ``torch.distributed``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from . import collectives, grids, groups
from .collectives import (
    COUNTS,
    Gathering,
    MaxBucket,
    Pending,
    SumBucket,
    all_gather_along,
    all_gather_chunks,
    all_gather_objects,
    barrier,
    broadcast_from,
    exchange,
    exchange_counts,
    gather_full,
    reduce_scatter,
    reset_counts,
    share_owned,
    start_all_gather_chunks,
)
from .grids import grid_of, spanning_groups, topology_token
from .groups import freeing_groups, group_key, group_rank, group_size, ordered_groups, release_groups

__all__ = [
    "COUNTS",
    "reset_counts",
    "SumBucket",
    "MaxBucket",
    "gather_full",
    "broadcast_from",
    "share_owned",
    "exchange",
    "exchange_counts",
    "Pending",
    "reduce_scatter",
    "all_gather_along",
    "all_gather_chunks",
    "start_all_gather_chunks",
    "Gathering",
    "all_gather_objects",
    "spanning_groups",
    "grid_of",
    "group_key",
    "ordered_groups",
    "topology_token",
    "release_groups",
    "freeing_groups",
    "barrier",
    "group_size",
    "group_rank",
    "collectives_through",
]

#: The modules that call ``torch.distributed`` (through their module attribute ``dist``).
_CALLERS = (collectives, groups, grids)


@contextlib.contextmanager
def collectives_through(backend: Any) -> Iterator[Any]:
    """Inside the block, every call this package makes to ``torch.distributed`` goes to ``backend``
    instead: an object with the same functions (the planner's recorder, ``dist_optim.plan.traffic``,
    which counts collectives and bytes and may answer them without communicating). The one hook
    by which code outside this package observes or replaces its collectives. Not thread-safe."""
    saved = [module.dist for module in _CALLERS]
    for module in _CALLERS:
        module.dist = backend  # type: ignore[attr-defined]
    try:
        yield backend
    finally:
        for module, original in zip(_CALLERS, saved):
            module.dist = original  # type: ignore[attr-defined]
        groups.forget_backend_places()  # the backend's groups may go with it
