"""What a saved optimizer state holds: param-group options as plain data, and the checks of a
state dict before it is loaded.

A saved optimizer state must load with ``torch.load(..., weights_only=True)`` (torch's default from
2.6, and what checkpoint tools use): tensors, numbers, strings, dtypes, lists, tuples and dicts
only. Some options are objects (Shampoo's grafting configs, Kron's update schedule) or a user's
callable. :func:`saved_group` writes each option in plain form, and :func:`restored_group` reads it
back against the group the loading optimizer was built with:

* a registered option class (:func:`register_option_class`: a dataclass of plain fields) is saved
  as ``{"dist_optim_option": <class name>, "fields": {...}}`` and rebuilt from them;
* any other callable cannot be saved as data, so its place holds
  ``{"dist_optim_option": "callable", "name": <qualified name>}`` and a load keeps the callable the
  optimizer was built with, as torch's ``LambdaLR`` keeps its lambdas out of its state dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["STATE_DICT_KEY", "TAG", "register_option_class", "saved_group", "restored_group", "check_state_dict"]

#: The key of ``DistOptimizer.state_dict()`` under which the class and the extra state are saved.
STATE_DICT_KEY = "dist_optim"

#: The key that marks a dict as an encoded option (no option of ours is a dict with this key).
TAG = "dist_optim_option"
_CALLABLE = "callable"
_CLASSES: dict[str, Any] = {}  # dataclass types by name


def register_option_class(cls: type) -> type:
    """Let instances of the dataclass ``cls`` be saved by their fields (usable as a decorator).
    Classes are named by their ``__name__``, which must be unique among registered classes."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_option_class: {cls.__name__} is not a dataclass")
    known = _CLASSES.get(cls.__name__)
    if known is not None and known is not cls:
        raise ValueError(f"register_option_class: two option classes are named {cls.__name__}")
    _CLASSES[cls.__name__] = cls
    return cls


def _plain(value: Any) -> Any:
    cls = _CLASSES.get(type(value).__name__)
    if cls is not None and cls is type(value):
        fields = {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(cls)}
        return {TAG: type(value).__name__, "fields": fields}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if callable(value) and not isinstance(value, type):
        name = f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
        return {TAG: _CALLABLE, "name": name}
    return value


def _restored(key: str, value: Any, built: Any) -> Any:
    if isinstance(value, Mapping) and TAG in value:
        kind = value[TAG]
        if kind == _CALLABLE:
            if not callable(built):
                raise ValueError(
                    f"option {key!r} was saved as the callable {value.get('name')}, which a state dict cannot "
                    f"hold; build the optimizer with that callable as {key} before loading"
                )
            return built
        cls = _CLASSES.get(kind)
        if cls is None:
            raise ValueError(
                f"option {key!r} was saved as an unknown {kind!r}; load it with the dist_optim that saved it"
            )
        return cls(**{k: _restored(key, v, None) for k, v in value["fields"].items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_restored(key, v, None) for v in value)
    if isinstance(value, dict):
        return {k: _restored(key, v, None) for k, v in value.items()}
    return value


def saved_group(group: Mapping[str, Any]) -> dict[str, Any]:
    """``group`` (without ``params``) with every option in plain form (module docstring)."""
    return {k: _plain(v) for k, v in group.items() if k != "params"}


def restored_group(saved: Mapping[str, Any], built: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`saved_group`; ``built`` is the loading optimizer's group, whose callables
    take the place of saved ones. Plain values (and groups saved before this format) pass through."""
    return {k: _restored(k, v, built.get(k)) for k, v in saved.items()}


def check_state_dict(optimizer: Any, state_dict: Mapping[str, Any], mine: str) -> None:
    """Refuse, with one line naming the cause, a state dict that is not ``optimizer``'s (a
    ``DistOptimizer`` named ``mine``; for its ``load_state_dict``): one saved from another class,
    with other groups, or missing options this optimizer declares (torch's loader would replace
    the groups and fail later, deep inside a step)."""
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise ValueError(f"{mine}.load_state_dict: expected a dict with 'state' and 'param_groups'")
    meta = state_dict.get(STATE_DICT_KEY)
    saved = meta.get("optimizer") if isinstance(meta, Mapping) else None
    if saved is not None and saved != mine:
        raise ValueError(
            f"{mine}.load_state_dict: this state dict was saved by {saved}; load it into a {saved}, or "
            f"convert the saved optimizer with dist_optim.convert(...) before saving"
        )
    groups = state_dict["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{mine}.load_state_dict: the state dict has {len(groups)} param groups, this optimizer "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups as the saved one"
        )
    for i, (options, group) in enumerate(zip(groups, optimizer.param_groups)):
        missing = sorted(optimizer.option_names - set(options))
        if missing:
            origin = f"saved by {saved}" if saved else "not saved by a dist_optim optimizer"
            raise ValueError(
                f"{mine}.load_state_dict: param group {i} of the state dict lacks {', '.join(missing)} "
                f"({origin}); load a state dict saved by this optimizer"
            )
        optimizer.validate_group({**options, "params": group["params"]})
