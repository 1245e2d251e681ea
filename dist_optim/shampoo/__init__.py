"""Shampoo and SOAP as a package: see :mod:`dist_optim.shampoo.optimizer`."""

from .optimizer import (
    AdaGradGraftingConfig,
    AdamGraftingConfig,
    DistributedShampoo,
    RMSpropGraftingConfig,
    SGDGraftingConfig,
)

__all__ = [
    "DistributedShampoo",
    "SGDGraftingConfig",
    "AdaGradGraftingConfig",
    "RMSpropGraftingConfig",
    "AdamGraftingConfig",
]
