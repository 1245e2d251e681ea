"""What the tests and the benchmarks share (as ``torch.testing`` is for torch): nothing here is
part of the optimizers, and nothing in the optimizers imports it.

- :mod:`dist_optim.testing.pools`: :class:`DistPool` (long-lived worker processes in one gloo or
  NCCL process group, running module-level functions on every rank), :func:`grid_groups` (a rank's
  TP and DP groups of a tp x dp grid, TP fastest-varying as in ColossalAI's mesh) and
  :func:`zero_chunks` (a rank's ZeRO chunks of full tensors and their layouts) and
  :func:`tp_zero_chunks` (TP slices cut into ZeRO chunks).
- :mod:`dist_optim.testing.models`: :func:`tiny_llama`, :func:`tiny_mixtral` (tiny Hugging Face
  causal LMs, seeded, that ShardFormer splits as it splits a real one) and their :data:`VOCAB`.
- :mod:`dist_optim.testing.matrices`: :func:`stress_momentum` (the momenta that stress Muon's fp32
  Newton-Schulz: rank 8, log-spaced singular values, Gaussian) and :func:`plain_newton_schulz` (the
  formula as written, the yardstick).

The dependency direction: ``tests/`` and ``bench/`` import this package; it imports ``torch``, the
core (``dist_optim.layout``) and, when a model is built, ``transformers``; never ``tests/`` or
``bench/`` (the wheel holds it, and ``tests/unit/test_install.py`` imports it where neither exists).
"""

from __future__ import annotations

from .matrices import STRESS_KINDS, plain_newton_schulz, stress_momentum
from .models import VOCAB, tiny_llama, tiny_mixtral
from .pools import COLLECTIVE_TIMEOUT, DistPool, grid_groups, tp_zero_chunks, zero_chunks

__all__ = [
    "COLLECTIVE_TIMEOUT",
    "STRESS_KINDS",
    "VOCAB",
    "DistPool",
    "grid_groups",
    "plain_newton_schulz",
    "stress_momentum",
    "tiny_llama",
    "tiny_mixtral",
    "zero_chunks",
    "tp_zero_chunks",
]
