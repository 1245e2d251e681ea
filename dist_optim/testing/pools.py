"""Running test and benchmark code on several processes (gloo on the CPU, or NCCL on GPUs).

:class:`DistPool` spawns N workers once (file-based rendezvous, no fixed ports), keeps them and
their process group alive, and runs module-level functions on all of them; a failure on any rank
is re-raised in pytest with that rank's traceback, and the pool is then replaced (a failed rank
may have left the others inside a collective). A rank that does not answer in time has its Python
stacks (every thread) in the error, read with :mod:`faulthandler`; the pool is replaced as well
when the wait for results is interrupted from outside (pytest-timeout's signal, Ctrl-C), so a hung
task cannot leave its workers busy, and its late results, to the next test. Spawning and importing
torch/colossalai is the slow part of a distributed test on two cores, so it is paid once per
session, not per test.
"""

from __future__ import annotations

import copy
import faulthandler
import gc
import importlib
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .. import comm

COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("DIST_OPTIM_TEST_TIMEOUT", "120")))

#: The signal on which a worker writes its Python stacks (every thread) to :func:`stacks_file`.
STACKS_SIGNAL = signal.SIGUSR1


def stacks_file(directory: str, rank: int) -> str:
    """Where rank ``rank`` of the pool whose rendezvous lives in ``directory`` writes its stacks."""
    return os.path.join(directory, f"stacks.{rank}")


def _worker(rank: int, world_size: int, init_file: str, tasks: Any, results: Any, backend: str = "gloo") -> None:
    # Kept open for the life of the process: faulthandler writes to its descriptor from the signal
    # handler, which works while the rank is blocked inside C++ (a gloo wait) holding the GIL.
    stacks = open(stacks_file(os.path.dirname(init_file), rank), "w")  # noqa: SIM115
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A gloo group is connected once its first member returns from new_group: a task that frees a
    # group at once on that rank (a refused plugin's __del__, the end-of-task release below) closes
    # its sockets while a slower rank still connects, which fails there with "Connection closed by
    # peer". torch's barrier at the end of new_group makes every rank return only once all have it.
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size)
    )
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank, as torchrun's LOCAL_RANK
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    _preload()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            result: tuple[int, bool, Any] = (rank, True, fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            result = (rank, False, traceback.format_exc())
        # A HybridParallelPlugin destroys its process groups when it is collected, and ColossalAI's
        # LayoutConverter reuses a cached gather plan while its group is alive. Left to the cyclic
        # collector, a task's plugin dies at a different moment on each rank, so one rank gathers
        # on the old group and another on the new one: a hang. Collecting on every rank between
        # tasks makes that moment the same everywhere. The destroyed groups are then freed only
        # once dist_optim's caches let them go: kept, each task's plugin left its gloo groups'
        # polling threads behind (hundreds per worker by the end of the suite, most of its CPU).
        # Freed inside freeing_groups: freed under the GIL, a group whose last collective had just
        # finished could hang its rank for ever (torch 2.5.1).
        with comm.freeing_groups():
            gc.collect()
            comm.release_groups()
        results.put(result)
    # destroy_process_group() can hang with gloo on torch 2.5.1; a barrier then exit is clean.
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


#: Imported by every worker before its first task (what nearly every task imports anyway).
PRELOAD = ("dist_optim", "dist_optim.plugins", "colossalai.booster")


def _preload() -> None:
    """Import :data:`PRELOAD` and freeze what exists then (``gc.freeze``): the ~400k objects of
    torch, ColossalAI and transformers, which the full collection between tasks would otherwise walk
    every time (most of a short checkpoint task's CPU time). Only objects made before the first task
    are frozen, so nothing a task makes (a plugin and its process groups) is kept out of a
    collection: every rank still destroys it in the same collection (``_worker``)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # a checkout without ColossalAI: its tasks import what they need
            pass
    gc.collect()
    gc.freeze()


class DistPool:
    """``world_size`` long-lived worker processes in one process group: gloo on CPU processes
    (the default), or ``backend="nccl"`` with one CUDA device per rank."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.world_size = world_size
        self.backend = backend
        self._background: ThreadPoolExecutor | None = None
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="dist_optim_pool_")
        init_file = os.path.join(self._dir, "rendezvous")
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, init_file, self._tasks[r], self._results, self.backend),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 600, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = timeout
        try:
            while len(out) + len(failures) < self.world_size:
                try:
                    rank, ok, payload = self._results.get(timeout=deadline)
                except queue.Empty:
                    break
                if ok:
                    # A tensor received from a worker holds a file descriptor for as long as it lives
                    # (torch's file_descriptor sharing): a suite that keeps results (a module-level
                    # cache of reference runs) would run out of descriptors ("received 0 items of
                    # ancdata"). A copy owns its memory, and the shared one is closed at once.
                    out[rank] = copy.deepcopy(payload)
                else:
                    failures[rank] = payload
                    # The other ranks may be stuck in a collective with the failed one: give them a
                    # short while to fail on their own, then replace the pool.
                    deadline = min(deadline, 15)
        except BaseException:
            # Interrupted from outside while the workers still run the task: kept, they would take
            # the next test's task only after this one, and put this one's results where the next
            # test reads its own. The stacks say where they were.
            missing = sorted(set(range(self.world_size)) - set(out) - set(failures))
            print(f"DistPool: {fn.__name__} interrupted\n{self._replace(missing)}", file=sys.stderr)
            raise
        missing = sorted(set(range(self.world_size)) - set(out) - set(failures))
        if missing:
            msg = f"ranks {missing} did not finish {fn.__name__} within {deadline:.0f}s"
            msg += "".join(f"\n--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items()))
            raise AssertionError(msg + "\n" + self._replace(missing))
        if failures:
            self._restart()
            raise AssertionError(
                "\n".join(f"--- rank {r} failed in {fn.__name__} ---\n{tb}" for r, tb in sorted(failures.items()))
            )
        return [out[r] for r in range(self.world_size)]

    def submit(self, fn: Callable[..., Any], *args: Any, timeout: float = 600, **kwargs: Any) -> Future[list[Any]]:
        """:meth:`run` from a background thread: the caller computes its own side meanwhile (a
        plan, a reference run), which would otherwise leave the workers' cores idle and wait for
        them. ``.result()`` gives run's list or raises its error. Tasks run one at a time, in the
        order submitted."""
        if self._background is None:
            self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist_pool")
        return self._background.submit(self.run, fn, *args, timeout=timeout, **kwargs)

    def _restart(self) -> None:
        self._kill()
        self._start()

    def _replace(self, ranks: list[int]) -> str:
        """The Python stacks of ``ranks`` (those still running a task), then a fresh pool."""
        stacks = self.stacks(ranks)
        self._restart()
        return stacks

    def stacks(self, ranks: list[int], wait: float = 5.0) -> str:
        """What ``ranks`` are doing now: each writes its Python stacks (every thread) on
        :data:`STACKS_SIGNAL`; what a rank wrote within ``wait`` seconds, or that it wrote nothing."""

        def size(r: int) -> int:
            path = stacks_file(self._dir, r)
            return os.path.getsize(path) if os.path.exists(path) else 0

        before = {r: size(r) for r in ranks}
        for r in ranks:
            pid = self._procs[r].pid
            if self._procs[r].is_alive() and pid is not None:
                os.kill(pid, STACKS_SIGNAL)
        end = time.monotonic() + wait
        last = dict(before)
        while time.monotonic() < end:
            time.sleep(0.25)
            now = {r: size(r) for r in ranks}
            # faulthandler writes a whole dump from its handler: written, and no longer growing.
            if all(now[r] > before[r] and now[r] == last[r] for r in ranks):
                break
            last = now
        parts = []
        for r in ranks:
            text = ""
            if size(r) > before[r]:
                with open(stacks_file(self._dir, r)) as f:
                    f.seek(before[r])
                    text = f.read().strip()
            parts.append(f"--- rank {r}: stacks ---\n{text or '(nothing written: the process is gone or blocked)'}")
        return "\n".join(parts)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        # The rendezvous file grows with every group created; nothing
        # reads it once the workers are gone, and a restart starts a new one.
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        if self._background is not None:
            self._background.shutdown(wait=True)
            self._background = None
        for q in self._tasks:
            q.put(None)
        for p in self._procs:
            p.join(timeout=20)
        self._kill()


# ---- process groups for a (tp, dp) grid ------------------------------------------------------
_GROUP_CACHE: dict[tuple[int, int], tuple[Any, Any]] = {}


def grid_groups(tp: int, dp: int) -> tuple[Any, Any]:
    """This rank's (tp_group, dp_group) for a tp×dp grid, TP fastest-varying as in ColossalAI's
    mesh. A world larger than tp*dp runs independent replicas of the grid. Collective: every
    rank must call it with the same arguments."""
    key = (tp, dp)
    if key in _GROUP_CACHE:
        return _GROUP_CACHE[key]
    world = dist.get_world_size()
    block = tp * dp
    if world % block:
        raise ValueError(f"world size {world} is not a multiple of tp*dp={block}")
    rank = dist.get_rank()
    mine_tp = mine_dp = None
    for base in range(0, world, block):
        for d in range(dp):
            ranks = [base + d * tp + t for t in range(tp)]
            g = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
            if rank in ranks:
                mine_tp = g
        for t in range(tp):
            ranks = [base + d * tp + t for d in range(dp)]
            g = dist.new_group(ranks, timeout=COLLECTIVE_TIMEOUT)
            if rank in ranks:
                mine_dp = g
    _GROUP_CACHE[key] = (mine_tp, mine_dp)
    return mine_tp, mine_dp


def zero_chunks(fulls: list[torch.Tensor], group: Any) -> tuple[list[torch.Tensor], dict[torch.Tensor, Any]]:
    """This rank's ZeRO chunks of full tensors sharded over ``group`` (padded as ZeRO pads), and
    their layouts: what a test binds an optimizer with to run it as ZeRO would."""
    return tp_zero_chunks(fulls, [None] * len(fulls), None, group)


def tp_zero_chunks(
    fulls: list[torch.Tensor], tp_dims: list[int | None], tp_group: Any, zero_group: Any
) -> tuple[list[torch.Tensor], dict[torch.Tensor, Any]]:
    """This rank's TP slice (along ``tp_dims``, None = replicated; ``tp_group`` read only for a dim) of
    each full tensor, cut into its ZeRO chunk over ``zero_group`` (padded as ZeRO pads), and their
    layouts: what a test binds an optimizer with to run it as HybridParallelPlugin with TP and
    ZeRO would."""
    from dist_optim.layout import ParamLayout, TPSplit, ZeroShard

    size, rank = dist.get_world_size(zero_group), dist.get_rank(zero_group)
    params, layouts = [], {}
    for full, dim in zip(fulls, tp_dims):
        shape = tuple(full.shape)
        tp = None
        if dim is not None:
            tp = TPSplit(dim, dist.get_world_size(tp_group), dist.get_rank(tp_group), tp_group)
        padding = (-ParamLayout(shape, tp).local_numel) % size
        layout = ParamLayout(shape, tp, ZeroShard(size, rank, padding, zero_group))
        p = layout.take_local(full)
        params.append(p)
        layouts[p] = layout
    return params, layouts
