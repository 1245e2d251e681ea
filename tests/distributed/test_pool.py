"""The session's process pool (``dist_optim.testing.pools``): its workers freeze what importing
made before their first task, and nothing a task makes; a task that hangs is reported with its
ranks' stacks and leaves a fresh pool, also when the wait is interrupted from outside."""

from __future__ import annotations

import gc
import os
import signal
import time
from typing import Any

import pytest

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


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _boost_once(path: str, kwargs: dict[str, Any]) -> int:
    """One training step of a tiny Llama through a HybridParallelPlugin at tp=2, ZeRO-1, with the
    optimizer ``path`` (swapped for ours); returns this worker's threads after it."""
    import torch
    from colossalai.booster import Booster

    from dist_optim import plugins
    from dist_optim.plugins.cpu import install, quiet_colossal
    from dist_optim.testing import VOCAB, tiny_llama
    from tests.helpers.booster import make_optimizer

    install()
    with quiet_colossal():
        model = tiny_llama()
        optimizer = make_optimizer(path, model, kwargs)
        plugin = plugins.HybridParallelPlugin(
            tp_size=2, pp_size=1, zero_stage=1, precision="bf16", overlap_communication=False
        )
        booster = Booster(plugin=plugin)
        model, optimizer, *_ = booster.boost(model, optimizer)
        ids = torch.arange(16).remainder(VOCAB).reshape(1, 16)
        booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
        optimizer.step()
    return _threads()


# LAMB holds the plugin's groups in the places of comm.group_size; GaLore also in the partition
# plans of its distributed projections (dist_optim.sharding.partition).
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
@pytest.mark.parametrize(
    "path, kwargs",
    [
        ("colossalai.nn.optimizer.Lamb", dict(lr=1e-2)),
        ("galore_torch.GaLoreAdamW", dict(lr=1e-3, galore=dict(rank=8, update_proj_gap=100, scale=0.25))),
    ],
    ids=["lamb", "galore"],
)
def test_a_tasks_destroyed_groups_leave_no_threads(pool4: DistPool, path: str, kwargs: dict[str, Any]) -> None:
    """A task's HybridParallelPlugin (tp=2, ZeRO-1: gloo groups, each polled by a thread of its
    own) destroys its groups when collected, and the worker then frees them (comm.release_groups):
    after three such tasks each worker runs as many threads as after one (counted in /proc). Kept
    by dist_optim's caches, every task left 6 behind (hundreds per worker by the end of the suite,
    most of its CPU time)."""
    pool4.run(_boost_once, path, kwargs)
    after_one = pool4.run(_threads)
    pool4.run(_boost_once, path, kwargs)
    pool4.run(_boost_once, path, kwargs)
    assert pool4.run(_threads) == after_one, after_one


def _boost_thrice() -> tuple[int, int]:
    """The worker's threads after the first and after the third of three boosts in one task (the
    pool's release between tasks not involved), each plugin collected before the next."""
    counts = []
    for _ in range(3):
        counts.append(_boost_once("colossalai.nn.optimizer.Lamb", dict(lr=1e-2)))
        gc.collect()
    return counts[0], counts[2]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_new_boost_frees_the_collected_plugins_groups(pool4: DistPool) -> None:
    """booster.boost (dist_optim.plugins.swap_optimizer) lets go of the groups of a plugin
    collected before it: three plugins made one after another in one process leave it running
    as many threads as one does."""
    for first, third in pool4.run(_boost_thrice):
        assert third == first, (first, third)


#: How long rank 1 waits before it makes its group.
LATE_GROUP_SECONDS = 1.0


def _seconds_in_new_group_while_rank_1_is_late() -> float:
    """After a barrier, rank 1 waits ``LATE_GROUP_SECONDS`` and then makes a group of itself alone;
    every rank returns how long its own ``new_group`` call took."""
    import torch.distributed as dist

    dist.barrier()
    start = time.monotonic()
    if dist.get_rank() == 1:
        time.sleep(LATE_GROUP_SECONDS)
    dist.new_group([1])
    return time.monotonic() - start


def test_new_group_returns_on_no_rank_before_every_rank_has_made_it(pool2: DistPool) -> None:
    """A rank that frees a group at once (a refused plugin) must not close its gloo sockets under a
    rank still connecting it: in the pool, new_group returns only once every rank has made the group,
    so rank 0, not even a member, waits for late rank 1 (without the barrier it returns at once).
    Half the delay is the margin for the ranks leaving the first barrier apart."""
    waited = pool2.run(_seconds_in_new_group_while_rank_1_is_late)
    assert min(waited) >= LATE_GROUP_SECONDS / 2, waited


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _hang_here_on_rank_1() -> None:
    """Rank 1 waits in a barrier that rank 0 never joins (gloo's own timeout is minutes away)."""
    import torch.distributed as dist

    if dist.get_rank() == 1:
        dist.barrier()


def test_a_hung_rank_is_reported_with_its_stacks_and_the_pool_replaced(pool2: DistPool) -> None:
    """A rank that does not answer within the run's timeout: the error names it and shows where it
    is (its Python stack, written by the worker itself on a signal), and the next task runs on
    fresh workers, not behind the hung one."""
    assert pool2.run(_rank) == [0, 1]  # started (a fresh pool spends seconds importing)
    with pytest.raises(AssertionError) as failed:
        pool2.run(_hang_here_on_rank_1, timeout=5)
    message = str(failed.value)
    assert "ranks [1] did not finish _hang_here_on_rank_1 within 5s" in message, message
    stacks = message.split("--- rank 1: stacks ---", 1)[-1]
    assert "_hang_here_on_rank_1" in stacks and "barrier" in stacks, message
    assert pool2.run(_rank, timeout=120) == [0, 1]


class _Interrupted(BaseException):
    """What pytest-timeout's signal method raises in the waiting test (also not an Exception)."""


def _sleep_then_answer(seconds: float) -> str:
    time.sleep(seconds)
    return "the interrupted task's answer"


def _answer(token: str) -> str:
    return token


def _interrupt(signum: int, frame: Any) -> None:
    raise _Interrupted


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="interrupts the wait with SIGALRM")
def test_an_interrupted_wait_replaces_the_pool(pool2: DistPool, capsys: pytest.CaptureFixture[str]) -> None:
    """The wait for a task's results interrupted from outside, as pytest-timeout interrupts a test
    that runs too long: the workers still running that task are replaced (their stacks printed),
    so the next task gets its own results at once, not the interrupted task's when it ends."""
    assert pool2.run(_rank) == [0, 1]  # started, so the interruption finds the task running
    previous = signal.signal(signal.SIGALRM, _interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(_Interrupted):
            pool2.run(_sleep_then_answer, 20.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    printed = capsys.readouterr().err
    assert "_sleep_then_answer interrupted" in printed and "--- rank 0: stacks ---" in printed, printed
    assert "in _sleep_then_answer" in printed, printed
    # The fresh pool's start-up (seconds of imports) counts against the timeout; the interrupted
    # task would answer only after its 20 s sleep, and its answer is not the one asserted.
    assert pool2.run(_answer, "the next task's answer", timeout=120) == ["the next task's answer"] * 2
