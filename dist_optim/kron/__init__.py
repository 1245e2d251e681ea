"""PSGD Kron as a package (see :mod:`.optimizer` for the algorithm and its distribution)."""

from .optimizer import DistributedKron, ProbabilitySchedule, precond_cost, precond_update_prob_schedule

__all__ = ["DistributedKron", "ProbabilitySchedule", "precond_update_prob_schedule", "precond_cost"]
