"""Optimizers with factored second moments, exact on TP slices and ZeRO chunks: Adafactor
(Shazeer & Stern, 2018, :mod:`.adafactor`) and CAME (Luo et al., 2023, :mod:`.came`).

Both keep row and column statistics of the *full* matrix while a rank holds a slice or a chunk of
it; :mod:`.statistics` holds that shared math and :mod:`.layout` its index geometry."""

from .adafactor import DistributedAdafactor
from .came import DistributedCAME

__all__ = ["DistributedAdafactor", "DistributedCAME"]
