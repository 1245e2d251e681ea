"""Which processes a group holds, in the one order every process follows, and how long groups live.

torch.distributed's answers about a group (size, rank, members) are cached here by group, since a
step asks them hundreds of times; :func:`ordered_groups` is the order in which every process walks
its groups so that collectives on overlapping groups cannot deadlock; :func:`release_groups` and
:func:`freeing_groups` let groups go without torch 2.5.1's freeing of a backend under the GIL. No
collective is issued here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch.distributed as dist

#: (size, rank, member ranks) of groups, with the group and the backend that answered (torch.distributed,
#: or the backend of ``collectives_through``: a simulated world answers for its own ranks), by
#: ``id(group)``: asking costs microseconds, hundreds of times a step. An entry is valid while its
#: backend is the one in use; it holds its group (until release_groups, or the end of the
#: ``collectives_through`` block for another backend), so that its id is not reused by a group with
#: other members (a stale key would order collectives differently on different ranks). Not for
#: ``None`` (re-made by each ``init_process_group``).
_PLACES: dict[int, tuple[Any, Any, tuple[int, int, tuple[int, ...]]]] = {}
_TORCH_DIST = dist  # ``dist`` itself is rebound inside collectives_through


def _place(group: Any) -> tuple[int, int, tuple[int, ...]]:
    if group is not None:
        cached = _PLACES.get(id(group))
        if cached is not None and cached[0] is group and cached[1] is dist:
            return cached[2]
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0, (0,)
    size = dist.get_world_size(group)
    key = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(size))
    place = size, dist.get_rank(group), key
    if group is not None:
        _PLACES[id(group)] = (group, dist, place)
    return place


def group_size(group: Any) -> int:
    """World size of ``group`` (1 when no process group is initialised)."""
    return _place(group)[0]


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (0 when no process group is initialised)."""
    return _place(group)[1]


def group_key(group: Any) -> tuple[int, ...]:
    """A key that orders groups identically on every process: their global member ranks."""
    return _place(group)[2]


def ordered_groups(groups: Iterable[Any]) -> list[Any]:
    """``groups`` without repeats, in the one order every process follows (:func:`group_key`):
    collectives issued group by group in this order cannot deadlock on overlapping groups."""
    unique: dict[tuple[tuple[int, ...], int], Any] = {}
    for g in groups:
        unique.setdefault((group_key(g), id(g)), g)
    return [unique[k] for k in sorted(unique, key=lambda k: k[0])]


def forget_backend_places() -> None:
    """Let go of what a ``collectives_through`` backend answered about its groups (its block ended)."""
    for key in [k for k, (_, backend, _) in _PLACES.items() if backend is not _TORCH_DIST]:
        del _PLACES[key]


_RELEASES = 0  # bumped by release_groups: part of topology_token


def release_groups() -> None:
    """Let go of the groups the caches hold (places; partition plans, by the token; not the live
    grids), so that destroyed ones are freed with their communicators (a gloo thread polling every
    10 ms, NCCL's memory): booster.boost and the test pool call it once a plugin is collected."""
    global _RELEASES
    with freeing_groups():
        _PLACES.clear()
    _RELEASES += 1


@contextlib.contextmanager
def freeing_groups() -> Iterator[None]:
    """Groups known at entry (torch.distributed's, the caches') whose last reference goes inside the block keep
    their backends until it ends, which frees them with the GIL released. torch 2.5.1 frees a backend under the GIL
    (pytorch#154976 changed that later); a gloo backend's destructor waits for its threads, and one freeing a
    collective that has just finished needs the GIL: both then wait for ever."""
    world = getattr(_TORCH_DIST.distributed_c10d, "_world", None)
    groups = [*(world.pg_map if world is not None else ()), *(g for g, _, _ in _PLACES.values())]
    held = [g._get_backend(d) for g in groups for d in getattr(g, "_device_types", ())]
    del groups  # else this frame would hold the groups until after their backends
    try:
        yield
    finally:
        held.clear()  # a backend's own Python object frees it without the GIL


def releases() -> int:
    """How many times :func:`release_groups` let groups go (a part of :func:`~.grids.topology_token`)."""
    return _RELEASES
