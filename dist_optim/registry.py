"""Which ordinary optimizer becomes which dist_optim optimizer, and how its options translate.

A :class:`Conversion` names a source class by its import path (so optional packages are never
imported just to register them), the dist_optim class it becomes, and an explicit translation of
each parameter group's hyperparameters. Options that the translation does not honour raise a
``ValueError`` naming the option; keys that are not hyperparameters of the source (e.g.
``initial_lr`` set by an LR scheduler, a user's ``name``) are carried over unchanged.

:func:`convert` is the public entry point; the plugins call it on whatever optimizer a user
passes to ``booster.boost``. Each optimizer package also registers its :class:`CatalogueEntry`
(name, class, recommended settings, param-group builder, planner options), from which every list
of optimizers derives (tests/unit/test_registry.py checks the lists that cannot: the tests' and
the benches').
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import DistOptimizer, class_path

__all__ = [
    "Conversion",
    "ANY",
    "HEAVYBALL_NEUTRAL",
    "register",
    "register_refusals",
    "lookup",
    "convert",
    "entries",
    "class_path",
    "CatalogueEntry",
    "Demo",
    "register_entry",
    "catalogue",
]

logger = logging.getLogger("dist_optim")


class _Any:
    def __repr__(self) -> str:
        return "ANY"


#: In :attr:`Conversion.neutral`, a source option that is accepted with any value (it does not
#: change the math, e.g. ``foreach``).
ANY: Any = _Any()

#: The group keys every heavyball (PyPI) optimizer keeps that change its update away from these
#: values (its chainable extras and error-correction states) or are bookkeeping: the start of each
#: heavyball conversion's :attr:`Conversion.neutral`.
HEAVYBALL_NEUTRAL: dict[str, Any] = {
    "caution": False,
    "cautious_weight_decay": False,
    "warmup_steps": 0,
    "mars": False,
    "mars_gamma": ANY,  # read only with mars=True
    "ecc": None,
    "param_ecc": None,
    "__class__": ANY,  # heavyball keeps its class among the defaults
    "storage_dtype": ANY,  # each conversion checks it against the parameters
}


@dataclass(frozen=True)
class Conversion:
    """How one ordinary optimizer class becomes a dist_optim optimizer.

    Attributes:
        source: ``module.QualName`` of the source class, as ``class_path`` prints it.
        target: the dist_optim class.
        options: ``(source optimizer, source group) -> our group options``. It may read
            optimizer attributes that the source keeps outside its groups (e.g. ``adam`` of
            ``colossalai.nn.optimizer.Lamb``) and raises ``ValueError`` for values it cannot honour.
        reads: the source group keys ``options`` translates.
        neutral: source group keys that are accepted only at the given value (or at any value
            with :data:`ANY`); any other source hyperparameter is refused.
        state: ``source state of one param -> our state`` for an optimizer that already stepped.
        refusal: why a class that needs layout-aware math has no exact dist_optim equivalent; set,
            :func:`convert` raises it (naming the fix) instead of letting the plugins pass the
            optimizer through to see its parameters' pieces as whole tensors.
    """

    source: str
    target: type[DistOptimizer]
    options: Callable[[torch.optim.Optimizer, Mapping[str, Any]], dict[str, Any]]
    reads: frozenset[str]
    neutral: Mapping[str, Any] = field(default_factory=dict)
    state: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    refusal: str | None = None


_REGISTRY: dict[str, Conversion] = {}


def register(conversion: Conversion) -> Conversion:
    _REGISTRY[conversion.source] = conversion
    return conversion


def register_refusals(sources: Mapping[str, str], target: type[DistOptimizer], fix: str) -> None:
    """Register each ``{source path: what its math does}`` as a refused conversion: :func:`convert`
    then names why and ``fix``, where the plugins would otherwise pass the optimizer through to
    see TP slices and ZeRO chunks as whole tensors."""
    for source, what in sources.items():
        register(Conversion(source, target, lambda opt, g: {}, frozenset(), refusal=f"{what}; {fix}"))


def entries() -> list[Conversion]:
    return list(_REGISTRY.values())


def lookup(optimizer_or_cls: torch.optim.Optimizer | type) -> Conversion | None:
    """The conversion registered for this exact class (subclasses may change the math, so they are
    not matched)."""
    cls = optimizer_or_cls if isinstance(optimizer_or_cls, type) else type(optimizer_or_cls)
    return _REGISTRY.get(class_path(cls))


def _convert_group(conv: Conversion, optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> dict[str, Any]:
    name = conv.source.rsplit(".", 1)[-1]
    hyper = set(optimizer.defaults)
    carried: dict[str, Any] = {}
    for key, value in group.items():
        if key == "params" or key in conv.reads:
            continue
        if key in conv.neutral:
            want = conv.neutral[key]
            if want is not ANY and value != want:
                raise ValueError(
                    f"convert: {name} option {key}={value!r} has no equivalent in {conv.target.__name__}; "
                    f"only {key}={want!r} can be converted"
                )
            continue
        if key in hyper:
            raise ValueError(
                f"convert: {name} option {key}={value!r} is not supported by {conv.target.__name__}; "
                "remove it or use the optimizer unconverted"
            )
        carried[key] = value
    options = conv.options(optimizer, group)
    return {**carried, **options}


def convert(optimizer: torch.optim.Optimizer, *, strict: bool = True) -> torch.optim.Optimizer:
    """The dist_optim equivalent of ``optimizer``: same parameter groups, hyperparameters and
    (if it already stepped) state.

    A dist_optim optimizer is returned unchanged. With ``strict`` (the default) an optimizer
    without an equivalent raises ``TypeError``; with ``strict=False`` it is returned unchanged
    (plugins do that: element-wise optimizers such as AdamW are correct under TP/ZeRO as they are).
    Options that cannot be honoured raise ``ValueError``.
    """
    if isinstance(optimizer, DistOptimizer):
        return optimizer
    conv = lookup(optimizer)
    if conv is None:
        if not strict:
            return optimizer
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise TypeError(f"convert: no dist_optim equivalent for {class_path(type(optimizer))} (registered: {known})")
    if conv.refusal is not None:
        raise ValueError(f"convert: {conv.source} {conv.refusal}")
    groups = [{"params": list(g["params"]), **_convert_group(conv, optimizer, g)} for g in optimizer.param_groups]
    # The new optimizer's defaults (used by add_param_group later) come from the source's
    # defaults; converting them must not warn twice or refuse a default no group uses.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            defaults = _convert_group(conv, optimizer, optimizer.defaults)
    except (ValueError, KeyError, TypeError):
        defaults = {k: v for k, v in groups[0].items() if k != "params"} if groups else {}
    new = conv.target(groups, **{k: v for k, v in defaults.items() if k in _init_args(conv.target)})
    if optimizer.state:
        if conv.state is None:
            raise ValueError(
                f"convert: {conv.source} has already stepped and its state cannot be carried over; "
                "convert before the first step"
            )
        for p, st in optimizer.state.items():
            converted = conv.state(st) if st else None
            if converted:  # a source that builds its state before the first step has nothing to carry
                new.state[p] = converted
    logger.info("dist_optim: converted %s to %s", conv.source, class_path(type(new)))
    return new


def _init_args(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls).parameters) - {"params"}


# ---- the catalogue: one entry per optimizer ------------------------------------------------------
@dataclass(frozen=True)
class Demo:
    """A row of ``make demo``'s comparison: its label, its learning rate (docs/convergence.md says
    how each was chosen) and, where the row shows the swap, the import path of the ordinary class
    a user would pass (None: the catalogue's name)."""

    label: str
    lr: float
    source: str | None = None


@dataclass(frozen=True)
class CatalogueEntry:
    """One optimizer of dist_optim, registered by its own package next to its conversions. Every
    list that names optimizers derives from these entries: the recipe's ``--optimizer`` short
    names and their settings, ``make demo``'s comparison, the planner's ``--optimizer`` and what
    bounds each one's transient memory.

    Attributes:
        name: the stable short name (``--optimizer`` of the recipe and the planner).
        target: the dist_optim class.
        recommended: the options the recipe builds it with (docs/convergence.md says why).
        param_groups: the ``dist_optim`` function that makes its param groups from a model, if it
            needs one; options named by that function's parameters go to it (:meth:`split`).
        plan_options: the options the planner builds it with (its constructor's defaults otherwise).
        refresh: options that bring a rare refresh (Shampoo's roots, GaLore's projectors) inside a
            few simulated steps (a refresh costs the same whatever its period).
        transient: what bounds its step's transient memory, for the plan's reader.
        demo: its row in ``make demo``'s comparison, if it has one.
        planned: whether it is a column of the planner's comparisons and of its real-run checks
            on every layout (False for a variant of another entry's class, SOAP of Shampoo's: the
            planner takes its name and builds it with ``plan_options``, and one layout's real run
            checks it).
    """

    name: str
    target: type
    recommended: Mapping[str, Any] = field(default_factory=dict)
    param_groups: Callable[..., list[dict[str, Any]]] | None = None
    plan_options: Mapping[str, Any] = field(default_factory=dict)
    refresh: Mapping[str, Any] = field(default_factory=dict)
    transient: str = ""
    demo: Demo | None = None
    planned: bool = True

    def split(self, options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``options`` as (the param-group builder's, the constructor's): a key that names a
        parameter of :attr:`param_groups` goes to the builder."""
        if self.param_groups is None:
            return {}, dict(options)
        import inspect

        named = {
            n
            for n, p in inspect.signature(self.param_groups).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "model"
        }
        return {k: v for k, v in options.items() if k in named}, {k: v for k, v in options.items() if k not in named}


_CATALOGUE: dict[str, CatalogueEntry] = {}


def register_entry(entry: CatalogueEntry) -> None:
    """Add ``entry`` to the catalogue (called at import of the optimizer's package); a name is
    registered once."""
    if entry.name in _CATALOGUE and _CATALOGUE[entry.name] != entry:
        raise ValueError(f"catalogue: {entry.name!r} is registered twice; give the second optimizer its own name")
    _CATALOGUE[entry.name] = entry


def catalogue() -> dict[str, CatalogueEntry]:
    """Every optimizer of dist_optim by its short name, in registration order."""
    import dist_optim  # noqa: F401  (each optimizer package registers its entry on import)

    return dict(_CATALOGUE)
