"""The session's process pool (``dist_optim.testing.pools``): its workers freeze what importing
made before their first task, and nothing a task makes."""

from __future__ import annotations

import gc

from dist_optim.testing import DistPool

_KEPT: list[object] = []


def _make_cycle() -> int:
    cycle: list[object] = []
    cycle.append(cycle)  # a container the cyclic collector tracks
    _KEPT.append(cycle)
    return gc.get_freeze_count()


def _cycle_is_collectable() -> bool:
    # gc.get_objects() lists the three generations, not the frozen (permanent) one.
    return any(o is _KEPT[-1] for o in gc.get_objects())


def test_workers_freeze_imports_but_no_task_objects(pool2: DistPool) -> None:
    frozen = pool2.run(_make_cycle)
    # torch, ColossalAI and transformers make ~400k tracked objects at import.
    assert all(n > 100_000 for n in frozen), frozen
    assert pool2.run(_cycle_is_collectable) == [True, True]
