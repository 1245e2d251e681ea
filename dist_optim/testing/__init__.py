"""What the tests and the benchmarks share (as ``torch.testing`` is for torch): nothing here is
part of the optimizers, and nothing in the optimizers imports it.

- :mod:`dist_optim.testing.pools`: :class:`DistPool` (long-lived worker processes in one gloo or
  NCCL process group, running module-level functions on every rank), :func:`grid_groups` (a rank's
  TP and DP groups of a tp x dp grid, TP fastest-varying as in ColossalAI's mesh) and
  :func:`zero_chunks` (a rank's ZeRO chunks of full tensors and their layouts).

The dependency direction: ``tests/`` and ``bench/`` import this package; it imports ``torch`` and
the core (``dist_optim.layout``), never ``tests/`` or ``bench/`` (the wheel holds it and
``tests/unit/test_install.py`` imports it where neither exists).
"""

from __future__ import annotations

from .pools import COLLECTIVE_TIMEOUT, DistPool, grid_groups, zero_chunks

__all__ = ["COLLECTIVE_TIMEOUT", "DistPool", "grid_groups", "zero_chunks"]
