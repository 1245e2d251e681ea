"""The planner's only uses of torch internals, in one guarded place.

A simulation runs the optimizers on meta tensors, and two things torch does not offer publicly are
needed for that: a random generator for meta tensors, and meta kernels shaped as on a chosen device.
Both are checked against the torch versions they were written for (:data:`CHECKED_TORCH`); on
another version the planner refuses with one line rather than simulating something else.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "CHECKED_TORCH",
    "DEVICES",
    "check_torch",
    "meta_generators",
    "meta_autocast",
    "meta_collectives",
    "c10d_group_size",
    "meta_strides_as",
    "strides_device",
]

#: torch releases (major, minor) whose internals below were read and tested: the pinned stack, and the
#: releases the scratch comparisons ran on.
CHECKED_TORCH = ((2, 5), (2, 9), (2, 13))
#: Device types a simulation can stand for (:func:`meta_strides_as`).
DEVICES = ("cuda", "cpu")


def _version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch() -> None:
    """Raise a ValueError (the planner's PlanError is one) unless this torch is one whose internals
    this module was checked against and has what it uses."""
    from torch import _meta_registrations

    if _version() not in CHECKED_TORCH or not hasattr(_meta_registrations, "device_hint"):
        checked = ", ".join(f"{a}.{b}" for a, b in CHECKED_TORCH)
        raise ValueError(
            f"dist_optim.plan: torch {torch.__version__} is not one the planner's simulation was checked "
            f"with ({checked}); install one of those (the project pins torch 2.5.1)"
        )


@contextlib.contextmanager
def meta_generators() -> Iterator[None]:
    """``torch.Generator(device="meta")`` does not exist; random draws on meta tensors accept a CPU
    generator (their values are not computed anyway). Inside the block a meta generator is a CPU one."""
    real = torch.Generator

    def generator(device: Any = "cpu") -> torch.Generator:
        return real(device="cpu" if torch.device(device).type == "meta" else device)

    torch.Generator = generator  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        torch.Generator = real  # type: ignore[misc]


@contextlib.contextmanager
def meta_autocast() -> Iterator[None]:
    """Autocast and checkpointing on meta tensors. ``torch.autocast(device_type="meta")`` raises (meta
    has no autocast dtype); transformers opens one, disabled, around its rotary embedding with the
    tensor's device type. Inside the block an autocast for "meta" is one for "cpu" (the forward of a
    meta model runs without autocast anyway)."""
    real = torch.autocast
    # Non-reentrant checkpointing recomputes inside torch.random.fork_rng(device_type="meta"), which
    # looks up a ``torch.meta`` device module even when told not to fork; an empty one satisfies it.
    had_module = hasattr(torch, "meta")
    if not had_module:
        torch.meta = types.ModuleType("torch.meta")  # type: ignore[attr-defined]

    class autocast(real):  # type: ignore[valid-type, misc]
        def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
            super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)

    torch.autocast = autocast  # type: ignore[misc]
    try:
        yield
    finally:
        torch.autocast = real  # type: ignore[misc]
        if not had_module:
            del torch.meta  # type: ignore[attr-defined]


#: The ``c10d`` operators ``torch.distributed``'s collectives dispatch to (torch 2.5 names; missing
#: ones are skipped).
C10D_OPS = (
    "broadcast_", "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "allgather_coalesced_",
    "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_", "reduce_", "gather_", "scatter_", "alltoall_", "alltoall_base_",
)  # fmt: skip


def _is_group(obj: Any) -> bool:
    return bool(obj._type().qualified_name().endswith("c10d.ProcessGroup"))


def c10d_group_size(args: tuple[Any, ...]) -> int:
    """The size of the process group a ``c10d`` operator call runs on (its arguments as the schema
    orders them: the group is passed boxed, as a TorchScript object)."""
    boxed = next(a for a in args if isinstance(a, torch.ScriptObject) and _is_group(a))
    return int(torch.distributed.ProcessGroup.unbox(boxed).size())


@contextlib.contextmanager
def meta_collectives(record: Callable[[str, tuple[Any, ...], int], None] | None = None) -> Iterator[None]:
    """``torch.distributed`` collectives on meta tensors: the ``c10d`` operators have CPU and CUDA
    kernels only, which hand the call to the process group's backend. Inside the block their meta
    kernel is the CPU one, so a ``fake``-backend group (which moves no data) completes them: model
    code that calls ``torch.distributed`` itself (ColossalAI's TP layers) runs on a meta model.
    ``record(name, args, group_size)`` sees each call: the operator's name, its arguments as the
    schema orders them (:func:`dist_optim.plan.traffic.c10d_bytes` reads them) and the size of its
    group (the operator receives the group boxed as a TorchScript object)."""
    lib = torch.library.Library("c10d", "IMPL")
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

    def on_cpu(op: Any) -> Any:
        name = op.__name__.split(".")[0]

        def kernel(*args: Any, **kwargs: Any) -> Any:
            if record is not None:
                record(name, args, c10d_group_size(args))
            return op.redispatch(cpu, *args, **kwargs)

        return kernel

    try:
        for name in C10D_OPS:
            packet = getattr(torch.ops.c10d, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                qualified = name if overload == "default" else f"{name}.{overload}"
                lib.impl(qualified, on_cpu(getattr(packet, overload)), "Meta")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def meta_strides_as(device: str) -> Iterator[None]:
    """Meta kernels whose output layout depends on the device shape their outputs as on ``device``
    inside the block: ``linalg.svd``'s ``Vh`` is row-major from cuSOLVER, column-major from LAPACK
    (torch's meta kernel asks ``device_hint``, which says "cuda" for a meta tensor). That stride
    decides whether a slice of ``Vh`` is contiguous, i.e. whether GaLore's stored projector is a
    copy or a view that keeps the whole ``Vh`` alive. Branches on ``tensor.device.type`` in the
    optimizers see "meta": they take the accelerator's branch where they test ``!= "cpu"``."""
    from torch import _meta_registrations as registrations

    global _strides_device
    real, previous = registrations.device_hint, _strides_device
    registrations.device_hint = lambda tensor: device
    _strides_device = device
    try:
        yield
    finally:
        registrations.device_hint = real
        _strides_device = previous


_strides_device: str | None = None


def strides_device() -> str | None:
    """The device meta kernels shape their outputs as (:func:`meta_strides_as`), None outside such a
    block: what a meta kernel's output layout may depend on besides its arguments."""
    return _strides_device
