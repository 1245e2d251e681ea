"""NCCL's rules for the tensors of a collective, checked where dist_optim issues one, and the
staging that keeps them when the tensors live in host memory.

NCCL communicates from one accelerator: every tensor handed to a collective must be on the group's
device and contiguous, and most collectives need the same dtype and size on every rank (NCCL does
not check those: a mismatch hangs or reads past a buffer). gloo forgives all of it, so a suite on
CPU processes would pass where a GPU cluster fails: ZeRO's ``cpu_offload`` hands the optimizer
host masters and gradients, and an NCCL all-reduce of a host tensor is ColossalAI's own failure
("No backend type associated with device type cpu", hpcaitech/ColossalAI#6400).

* :class:`Staging`: the tensors of one collective on the group's device. A tensor elsewhere (a
  host master under offload) is copied in, through a pinned host buffer where an accelerator
  exists (torch's caching host allocator reuses them), and the output copied back into the
  caller's tensor once the collective is done. :data:`STAGED` counts the bytes copied each way
  (``bench/bench_step.py --offload`` prints them against the bytes communicated).
* :func:`check`: the rules on the tensors finally handed to ``torch.distributed``: on the group's
  device, contiguous, one dtype; and, in ``check`` and ``nccl`` modes, the same operation, dtype
  and sizes on every rank of the group (one small all-gather of each rank's description before
  the collective, through torch.distributed's own function, so that counters of the real
  collectives do not see it).
* :data:`MODE` (``DIST_OPTIM_COLLECTIVE_RULES``): ``""`` (default) the local rules only; ``check``
  also across ranks; ``nccl`` also treats every group of a CPU backend as an NCCL group on a
  simulated accelerator, whose memory is what :class:`Staging` made: a host tensor handed to a
  collective is refused as NCCL would refuse it. The test suite runs in ``nccl`` mode.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .groups import group_key, group_rank, group_size

__all__ = ["MODE", "MODES", "STAGED", "CollectiveRuleError", "Staging", "StagedWork", "check", "group_device"]

MODES = ("", "check", "nccl")


def _mode() -> str:
    value = os.environ.get("DIST_OPTIM_COLLECTIVE_RULES", "")
    if value not in MODES:
        raise ValueError(
            f"DIST_OPTIM_COLLECTIVE_RULES={value!r}: use one of {', '.join(repr(m) for m in MODES)} "
            "(dist_optim.comm.rules)"
        )
    return value


#: The rules in force (module docstring); read from the environment at import, tests may set it.
MODE = _mode()
#: Whether :class:`Staging` copies tensors to the group's device (tests switch it off to show the
#: rules catching what staging prevents).
STAGE = True
#: Bytes copied to ("in") and back from ("out") groups' devices since :func:`reset_staged`.
STAGED: collections.Counter[str] = collections.Counter()

#: Backend name -> the device type it communicates from.
_BACKEND_DEVICES = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "hccl": "npu", "xccl": "xpu", "ucc": "cuda"}
#: The attribute marking a tensor as on the simulated accelerator (``nccl`` mode) while Staging
#: hands it to a collective: the only host tensors the rules accept there (a set of tensors would
#: compare them by value).
_SIMULATED = "_dist_optim_simulated_device"
#: The dtypes a rank's description names by index (cross-rank check).
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
)
_OPS = ("all_reduce", "all_gather", "broadcast", "all_to_all")
#: torch.distributed's own all-gather, taken before anyone wraps it: the description exchange is
#: not one of dist_optim's collectives.
_RAW_ALL_GATHER = c10d.all_gather_into_tensor


class CollectiveRuleError(RuntimeError):
    """A collective NCCL would refuse (or hang on), refused before it is issued."""


def reset_staged() -> None:
    STAGED.clear()


def _backend_devices(group: Any) -> set[str] | None:
    """The device types ``group``'s backend communicates from, or None where unknown."""
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError, AttributeError):
        return None
    kinds = set()
    for part in backend.split(","):
        device, _, name = part.rpartition(":")
        kinds.add(device or _BACKEND_DEVICES.get(name, name))
    return kinds


def _device_of(group: Any) -> tuple[torch.device | None, bool]:
    """:func:`group_device` and whether that device is the simulated accelerator (``nccl`` mode on
    a host backend), from one look at the group's backend: asked once per collective."""
    kinds = _backend_devices(group)
    if kinds is None or "cpu" in kinds:
        simulated = MODE == "nccl" and kinds is not None
        return (torch.device("cpu") if simulated else None), simulated
    kind = sorted(kinds)[0]
    module = getattr(torch, kind, None)
    index = module.current_device() if module is not None and hasattr(module, "current_device") else 0
    return torch.device(kind, index), False


def group_device(group: Any) -> torch.device | None:
    """The device ``group`` communicates from, where tensors elsewhere must be staged: the
    current accelerator for a device backend (NCCL: ``cuda:<current>``), ``None`` where the
    backend takes host tensors (gloo) and the rules do not simulate one."""
    return _device_of(group)[0]


def _on_device(t: torch.Tensor, device: torch.device | None, simulated: bool) -> bool:
    if device is None:
        return True
    if simulated:
        return t.device.type != "cpu" or getattr(t, _SIMULATED, False)
    return t.device == device


class Staging:
    """The tensors of one collective on ``group``'s device (module docstring): :meth:`send` for
    inputs, :meth:`recv` for outputs, :meth:`finish` (or a :class:`StagedWork`'s ``wait``) copies
    the staged outputs back into the caller's tensors. A no-op where the tensors are on the device."""

    def __init__(self, group: Any, active: bool = True) -> None:
        self.group = group
        device, simulated = _device_of(group) if STAGE and active else (None, False)
        self.device, self.simulated = device, device is not None and simulated
        self._back: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._marked: list[torch.Tensor] = []  # simulated: the caller's tensors, marked for this collective

    def _simulate(self, t: torch.Tensor) -> torch.Tensor:
        """The simulated accelerator's copy of ``t`` is ``t`` itself, marked until :meth:`finish`:
        no allocation, so that what a test measures of a step is what a real run allocates."""
        setattr(t, _SIMULATED, True)
        self._marked.append(t)
        return t

    def _here(self, t: torch.Tensor) -> bool:
        return _on_device(t, self.device, self.simulated)

    def send(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the group's device (itself where it is there already)."""
        if self._here(t):
            return t
        STAGED["in"] += t.numel() * t.element_size()
        if self.simulated:
            return self._simulate(t)
        assert self.device is not None
        if t.device.type == "cpu" and torch.cuda.is_available() and not t.is_pinned():
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t)
            t = pinned
        return t.to(self.device, non_blocking=True)

    def recv(self, t: torch.Tensor, filled: bool = False) -> torch.Tensor:
        """A buffer on the group's device the collective writes, copied back into ``t`` by
        :meth:`finish`; ``filled``: it starts with ``t``'s values (an in-place reduction)."""
        if self._here(t):
            return t
        if filled:
            staged = self.send(t)
        elif self.simulated:
            staged = self._simulate(t)
        else:
            staged = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        self._back.append((t, staged))
        return staged

    def finish(self) -> None:
        for t, staged in self._back:
            STAGED["out"] += staged.numel() * staged.element_size()
            if staged is not t:
                t.copy_(staged)
        for t in self._marked:
            setattr(t, _SIMULATED, False)
        self._back, self._marked = [], []


class StagedWork:
    """An asynchronous collective on staged tensors: ``wait()`` waits, then copies the outputs back."""

    def __init__(self, work: Any, staging: Staging) -> None:
        self.work, self.staging = work, staging

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
        self.staging.finish()


def _fail(name: str, group: Any, what: str, fix: str) -> CollectiveRuleError:
    return CollectiveRuleError(f"{name} on the group of ranks {group_key(group)}: {what}; {fix}")


def check(
    name: str,
    group: Any,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    *,
    src: int = -1,
    send_splits: Sequence[int] | None = None,
    recv_splits: Sequence[int] | None = None,
) -> None:
    """Refuse the collective ``name`` (one of all_reduce, all_gather, broadcast, all_to_all) where
    NCCL would (module docstring). ``inputs``/``outputs`` are the tensors handed to it (the same
    tensor for in-place ones); ``src`` the broadcast's source; the all_to_all's split sizes."""
    device, simulated = _device_of(group)
    tensors = [*inputs, *outputs]
    for t in tensors:
        if not t.is_contiguous():
            raise _fail(name, group, f"a non-contiguous tensor {tuple(t.shape)}", "pass a contiguous buffer")
        if not _on_device(t, device, simulated):
            raise _fail(
                name,
                group,
                f"a {t.device.type} tensor ({tuple(t.shape)}, {t.dtype}) on a group that communicates from "
                + ("a simulated accelerator (DIST_OPTIM_COLLECTIVE_RULES=nccl)" if simulated else str(device)),
                "stage it through dist_optim.comm.rules.Staging (NCCL refuses host tensors)",
            )
    if len({t.dtype for t in tensors}) > 1:
        raise _fail(name, group, f"mixed dtypes {sorted({str(t.dtype) for t in tensors})}", "use one dtype")
    size = group_size(group)
    numel_in, numel_out = sum(t.numel() for t in inputs), sum(t.numel() for t in outputs)
    if name == "all_gather" and numel_out != size * numel_in:
        raise _fail(name, group, f"output of {numel_out} elements for {size} x {numel_in}", "size it group x input")
    if name == "all_to_all" and (sum(send_splits or ()) != numel_in or sum(recv_splits or ()) != numel_out):
        raise _fail(name, group, f"split sizes {send_splits}/{recv_splits} for {numel_in}/{numel_out} elements", "")
    if MODE and size > 1 and dist.is_available() and dist.is_initialized():
        where = torch.device("cpu") if device is None or simulated else device
        _check_across(name, group, tensors[0].dtype, numel_in, src, send_splits, recv_splits, where)


def _check_across(
    name: str,
    group: Any,
    dtype: torch.dtype,
    numel: int,
    src: int,
    send_splits: Sequence[int] | None,
    recv_splits: Sequence[int] | None,
    where: torch.device,
) -> None:
    """Every rank's description of the collective it is about to issue, all-gathered (on ``where``,
    the device the group communicates from): the same operation, dtype and (where NCCL needs them
    equal) sizes everywhere, else an error on every rank."""
    size, me = group_size(group), group_rank(group)
    kind = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
    mine = [_OPS.index(name), kind, numel, src, *(send_splits or [0] * size), *(recv_splits or [0] * size)]
    desc = torch.tensor(mine, dtype=torch.int64, device=where)
    every = torch.empty(size * desc.numel(), dtype=torch.int64, device=where)
    _RAW_ALL_GATHER(every, desc, group=group)
    rows = every.view(size, -1).tolist()
    ops = {_OPS[r[0]] for r in rows}
    if len(ops) > 1:
        raise _fail(
            name,
            group,
            f"the ranks issue different collectives ({', '.join(_OPS[r[0]] for r in rows)}, by rank)",
            "every rank must issue the same collectives in the same order",
        )
    names = [str(_DTYPES[r[1]]) if r[1] < len(_DTYPES) else "other" for r in rows]
    if len(set(names)) > 1:
        raise _fail(name, group, f"dtypes differ across ranks ({', '.join(names)}, by rank)", "use one dtype")
    if name in ("all_reduce", "all_gather", "broadcast") and len({r[2] for r in rows}) > 1:
        raise _fail(
            name,
            group,
            f"sizes differ across ranks ({', '.join(str(r[2]) for r in rows)} elements, by rank)",
            "every rank must send the same number of elements (NCCL reads past the smaller buffers)",
        )
    if name == "broadcast" and len({r[3] for r in rows}) > 1:
        raise _fail(name, group, f"sources differ ({[r[3] for r in rows]}, by rank)", "broadcast from one rank")
    if name == "all_to_all":
        for a in range(size):
            for b in range(size):
                sent, got = rows[a][4 + b], rows[b][4 + size + a]
                if sent != got:
                    raise _fail(
                        name,
                        group,
                        f"rank {a} sends {sent} elements to rank {b}, which expects {got} (this is rank {me})",
                        "the send and receive split sizes must agree pairwise",
                    )
