"""The planner's only uses of torch internals, in one guarded place.

A simulation runs the optimizers on meta tensors, and two things torch does not offer publicly are
needed for that: a random generator for meta tensors, and meta kernels shaped as on a chosen device.
Both are checked against the torch versions they were written for (:data:`CHECKED_TORCH`); on
another version the planner refuses with one line rather than simulating something else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["CHECKED_TORCH", "DEVICES", "check_torch", "meta_generators", "as_device"]

#: torch releases (major, minor) whose internals below were read and tested: the pinned stack, and the
#: releases the scratch comparisons ran on.
CHECKED_TORCH = ((2, 5), (2, 9), (2, 13))
#: Device types a simulation can stand for (:func:`as_device`).
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
def as_device(device: str) -> Iterator[None]:
    """Meta kernels whose output layout depends on the device shape their outputs as on ``device``
    inside the block: ``linalg.svd``'s ``Vh`` is row-major from cuSOLVER, column-major from LAPACK
    (torch's meta kernel asks ``device_hint``, which says "cuda" for a meta tensor). That stride
    decides whether a slice of ``Vh`` is contiguous, i.e. whether GaLore's stored projector is a
    copy or a view that keeps the whole ``Vh`` alive. Branches on ``tensor.device.type`` in the
    optimizers see "meta": they take the accelerator's branch where they test ``!= "cpu"``."""
    from torch import _meta_registrations as registrations

    real = registrations.device_hint
    registrations.device_hint = lambda tensor: device
    try:
        yield
    finally:
        registrations.device_hint = real
