"""LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes", arXiv:1904.00962), exact on TP slices and ZeRO chunks: :mod:`.optimizer`."""

from .optimizer import DistributedLamb

__all__ = ["DistributedLamb"]
