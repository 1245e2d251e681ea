"""dist_optim: optimizers that give the single-device result under tensor parallelism and ZeRO.

Each optimizer is one class: unbound it is the single-device algorithm; bound to parameter
layouts (``bind``) it is exact on TP slices and ZeRO chunks. ``dist_optim.plugins`` holds all
that is ColossalAI's: it swaps ordinary optimizers for these when a model is boosted and binds them.
"""

from .base import DistOptimizer
from .factored.adafactor import DistributedAdafactor
from .factored.came import DistributedCAME
from .galore import DistributedGaLore, galore_param_groups
from .kron import DistributedKron
from .lamb.optimizer import DistributedLamb
from .layout import ParamLayout, TPSplit, ZeroShard
from .muon import DistributedMuon, DistributedNorMuon, muon_param_groups, watch_attention_logits
from .registry import convert
from .shampoo import (
    AdaGradGraftingConfig,
    AdamGraftingConfig,
    DistributedShampoo,
    RMSpropGraftingConfig,
    SGDGraftingConfig,
)

__all__ = [
    "DistributedAdafactor",
    "DistributedCAME",
    "DistributedGaLore",
    "galore_param_groups",
    "DistOptimizer",
    "DistributedLamb",
    "DistributedKron",
    "DistributedMuon",
    "DistributedNorMuon",
    "muon_param_groups",
    "watch_attention_logits",
    "ParamLayout",
    "TPSplit",
    "ZeroShard",
    "convert",
    "DistributedShampoo",
    "SGDGraftingConfig",
    "AdaGradGraftingConfig",
    "RMSpropGraftingConfig",
    "AdamGraftingConfig",
]

__version__ = "0.1.0"
