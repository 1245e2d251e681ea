"""Layout-independent optimizer checkpoints for dist_optim optimizers behind a ColossalAI booster.

ColossalAI's checkpoint IO assumes every optimizer state tensor has the parameter's (or the ZeRO
shard's) shape; factored statistics, preconditioner blocks and projectors do not, and ZeRO's IO
reshapes them into the parameter's shape. For our optimizers ``booster.save_optimizer`` /
``load_optimizer`` therefore use this format instead:

* the state of every parameter in **full-tensor form** (``DistOptimizer.full_state()``), keyed by
  the parameter's **name** in the model, plus each param group's hyperparameters and names, and
  the optimizer's extra state (e.g. random generators);
* ``shard=False``: one file (``torch.save``); ``shard=True``: a folder of files of at most
  ``size_per_shard`` MB and an index ``dist_optim_optimizer.index.json``.

Every file holds plain data only (tensors, numbers, strings, lists, dicts; option objects as their
fields, ``dist_optim.states.saved``) and is read with ``torch.load(..., weights_only=True)``.
Nothing in it depends on TP, ZeRO or pipeline layout, so a run saved at tp=2 x zero=2 resumes at
tp=1 x dp=4, on one process, or with another plugin. Files are written to a temporary name and
renamed, so a failed save does not destroy the previous checkpoint; a load validates everything
before it changes the optimizer. Other optimizers keep ColossalAI's own format.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
from colossalai.interface.optimizer import OptimizerWrapper

from dist_optim import comm
from dist_optim.base import DistOptimizer
from dist_optim.states.saved import restored_group, same_optimizer, saved_group, saved_name

__all__ = ["FORMAT", "INDEX_NAME", "DistOptimCheckpointMixin", "read_checkpoint"]

FORMAT = "dist_optim.optimizer/1"
MASTER_KEY = "__master__"  # a parameter's fp32 master weight, next to its state in sharded files
INDEX_NAME = "dist_optim_optimizer.index.json"


def _inner(optimizer: Any) -> Any:
    return optimizer.optim if isinstance(optimizer, OptimizerWrapper) else optimizer


def _names(optim: DistOptimizer) -> list[str]:
    names = getattr(optim, "param_names", None)
    params = [p for g in optim.param_groups for p in g["params"]]
    if not names or any(p not in names for p in params):
        raise ValueError(
            "dist_optim checkpoint: the optimizer's parameters have no names; boost the model with a "
            "dist_optim.plugins plugin, which records them"
        )
    return [names[p] for p in params]


def _group_meta(optim: DistOptimizer, names: list[str]) -> list[dict[str, Any]]:
    out, i = [], 0
    for group in optim.param_groups:
        n = len(group["params"])
        meta = saved_group(group)  # plain data: the files load with weights_only=True
        meta["params"] = names[i : i + n]
        out.append(meta)
        i += n
    return out


class DistOptimCheckpointMixin:
    """Mixed into a ColossalAI ``CheckpointIO``: our optimizers get the layout-independent format.

    ``writer`` says whether this rank writes its pipeline stage's part (one rank per stage: the
    states are replicated over TP and ZeRO after ``full_state()``).
    """

    def _dist_optim_is_writer(self) -> bool:
        return True

    # ---- save ---------------------------------------------------------------------------------
    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        optim = _inner(optimizer)
        if not isinstance(optim, DistOptimizer):
            return super().save_optimizer(  # type: ignore[misc]
                optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async
            )
        names = _names(optim)
        states = optim.full_state()  # collective over TP / ZeRO / work groups
        masters = _full_masters(optim, names)  # collective too
        writer = self._dist_optim_is_writer()
        part = {
            "groups": _group_meta(optim, names),
            "state": {n: _cpu(s) for n, s in zip(names, states) if s},
            "extra": optim.extra_state(),
            "masters": masters,
        } if writer else None  # fmt: skip
        parts = [p for p in comm.all_gather_objects(part) if p is not None] if shard is False else None
        if shard:
            self._save_sharded(optim, checkpoint, part, size_per_shard)
        elif torch.distributed.get_rank() == 0:
            assert parts is not None  # gathered above whenever shard is False
            payload = {
                "format": FORMAT,
                "optimizer": saved_name(type(optim)),
                "groups": [p["groups"] for p in parts],  # one list per pipeline stage
                "state": {k: v for p in parts for k, v in p["state"].items()},
                "extra": parts[0]["extra"],
                "masters": {k: v for p in parts for k, v in p["masters"].items()},
            }
            tmp = f"{checkpoint}.tmp-{os.getpid()}"
            os.makedirs(os.path.dirname(os.path.abspath(checkpoint)), exist_ok=True)
            torch.save(payload, tmp)
            os.replace(tmp, checkpoint)
        comm.barrier()

    def _save_sharded(self, optim: DistOptimizer, checkpoint: str, part: dict[str, Any] | None, mb: int) -> None:
        rank = torch.distributed.get_rank()
        tmp = f"{checkpoint.rstrip('/')}.tmp-dist_optim"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        comm.barrier()
        files: dict[str, str] = {}
        if part is not None:
            limit = max(1, mb) * 1024 * 1024
            chunk: dict[str, Any] = {}
            size = 0
            k = 0
            for name, state in part["state"].items():
                if name in part["masters"]:
                    state = {**state, MASTER_KEY: part["masters"][name]}
                nbytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
                if chunk and size + nbytes > limit:
                    k = _flush(tmp, rank, k, chunk, files)
                    chunk, size = {}, 0
                chunk[name] = state
                size += nbytes
            if chunk:
                _flush(tmp, rank, k, chunk, files)
        info = comm.all_gather_objects(
            None if part is None else {"files": files, "groups": part["groups"], "extra": part["extra"]}
        )
        if rank == 0:
            parts = [p for p in info if p is not None]
            # Hyperparameters (tuples, dtypes, option classes as their fields) and extra state keep
            # their Python types in a torch file; the JSON index only says where each parameter's state is.
            index = {
                "format": FORMAT,
                "optimizer": saved_name(type(optim)),
                "weight_map": {n: f for p in parts for n, f in p["files"].items()},
                "meta_file": "meta.bin",
            }
            torch.save(
                {"groups": [p["groups"] for p in parts], "extra": parts[0]["extra"]}, os.path.join(tmp, "meta.bin")
            )
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump(index, f, indent=1)
            if os.path.isdir(checkpoint):
                shutil.rmtree(checkpoint)
            elif os.path.exists(checkpoint):
                os.remove(checkpoint)
            os.replace(tmp, checkpoint)
        comm.barrier()

    # ---- load ---------------------------------------------------------------------------------
    def load_optimizer(self, optimizer: Any, checkpoint: str, *args: Any, **kwargs: Any) -> None:
        optim = _inner(optimizer)
        if not isinstance(optim, DistOptimizer):
            return super().load_optimizer(optimizer, checkpoint, *args, **kwargs)  # type: ignore[misc]
        payload = read_checkpoint(checkpoint)
        names = _names(optim)
        saved_cls = payload["optimizer"]
        if not same_optimizer(saved_cls, type(optim)):
            raise ValueError(
                f"optimizer checkpoint {checkpoint} holds {saved_cls} state; it cannot be loaded into "
                f"{type(optim).__name__}"
            )
        groups = _match_groups(payload["groups"], optim, names, checkpoint)
        states = [payload["state"].get(n, {}) for n in names]
        masters = _local_masters(optim, names, payload.get("masters", {}), checkpoint)
        optim.load_full_state(states)  # validates shapes before replacing anything
        with torch.no_grad():
            for p, value in masters:
                p.copy_(value)
        for group, meta in zip(optim.param_groups, groups):
            for key, value in restored_group(meta, group).items():
                if key != "params":
                    group[key] = value
        optim.load_extra_state(payload["extra"])


def _match_groups(stages: list[list[dict[str, Any]]], optim: DistOptimizer, names: list[str], path: str) -> list:
    """The saved hyperparameters of each local param group, matched by group index and names.

    Each writer (pipeline stage, MoE expert set) saved its own list of groups; group ``gi`` of the
    model is the union of every writer's group ``gi``, so a rank may hold parameters that several
    writers saved (a run saved with pp=2 or ep=2 loads without them)."""
    mine: list[dict[str, Any]] = []
    i = 0
    for gi, group in enumerate(optim.param_groups):
        local = names[i : i + len(group["params"])]
        i += len(group["params"])
        saved = [stage[gi] for stage in stages if gi < len(stage)]
        union = set().union(*(s["params"] for s in saved)) if saved else set()
        candidates = [s for s in saved if set(local) & set(s["params"])] if local else saved
        found = candidates[0] if candidates else None
        if found is None or not set(local) <= union:
            raise ValueError(
                f"optimizer checkpoint {path}: param group {gi} of this optimizer ({len(local)} params, e.g. "
                f"{local[:2]}) does not match the checkpoint's groups; was it saved from another model or grouping?"
            )
        mine.append(found)
    return mine


def _full_masters(optim: DistOptimizer, names: list[str]) -> dict[str, torch.Tensor]:
    """Full fp32 master weights by name when the optimizer steps copies of the working params."""
    if not getattr(optim, "separate_masters", False):
        return {}
    params = [p for g in optim.param_groups for p in g["params"]]
    fulls = comm.gather_full([(optim.layout(p), p.detach()) for p in params])
    return {n: f.cpu().clone() for n, f in zip(names, fulls)}


def _local_masters(
    optim: DistOptimizer, names: list[str], masters: dict[str, torch.Tensor], path: str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's pieces of the saved masters, checked before anything is written: after
    ``booster.load_model`` ZeRO's masters hold the bf16/fp16 working weights upcast, and the
    checkpoint's exact fp32 values replace them (so load the model first, then the optimizer)."""
    if not getattr(optim, "separate_masters", False) or not masters:
        return []
    out = []
    params = [p for g in optim.param_groups for p in g["params"]]
    for p, name in zip(params, names):
        if name not in masters:
            continue
        layout = optim.layout(p)
        full = masters[name]
        if tuple(full.shape) != layout.full_shape:
            raise ValueError(
                f"optimizer checkpoint {path}: master weight {name!r} has shape {tuple(full.shape)}, the model's is "
                f"{layout.full_shape}; was it saved from another model?"
            )
        out.append((p, layout.take_local(full.to(p.device, p.dtype)).view_as(p)))
    return out


def _cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _flush(folder: str, rank: int, k: int, chunk: dict[str, Any], files: dict[str, str]) -> int:
    name = f"optim-r{rank:05d}-{k:05d}.bin"
    torch.save(chunk, os.path.join(folder, name))
    for param in chunk:
        files[param] = name
    return k + 1


def read_checkpoint(checkpoint: str) -> dict[str, Any]:
    """The payload of a dist_optim optimizer checkpoint (a directory with its index, or one file),
    checked for format; a clear ValueError for anything else."""
    try:
        if os.path.isdir(checkpoint):
            index_path = os.path.join(checkpoint, INDEX_NAME)
            if not os.path.exists(index_path):
                raise ValueError(
                    f"{checkpoint} is not a dist_optim optimizer checkpoint (no {INDEX_NAME}); it was saved "
                    "for another optimizer or by another plugin"
                )
            with open(index_path) as f:
                index = json.load(f)
            _check_format(index, checkpoint)
            state: dict[str, Any] = {}
            for file in sorted(set(index["weight_map"].values())):
                state.update(torch.load(os.path.join(checkpoint, file), map_location="cpu", weights_only=True))
            masters = {n: st.pop(MASTER_KEY) for n, st in state.items() if MASTER_KEY in st}
            meta = torch.load(os.path.join(checkpoint, index["meta_file"]), map_location="cpu", weights_only=True)
            return {
                "optimizer": index["optimizer"],
                "groups": meta["groups"],
                "state": state,
                "extra": meta["extra"],
                "masters": masters,
            }
        payload = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user-facing error
        raise ValueError(f"cannot read optimizer checkpoint {checkpoint}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(payload, dict):
        raise ValueError(f"{checkpoint} is not a dist_optim optimizer checkpoint")
    _check_format(payload, checkpoint)
    return payload


def _check_format(payload: dict[str, Any], path: str) -> None:
    if payload.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a dist_optim optimizer checkpoint (format {payload.get('format')!r}, expected {FORMAT!r}); "
            "it was saved for another optimizer or by another plugin"
        )
