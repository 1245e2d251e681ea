"""The parity grid (docs/design.md, "The parity grid"), run inside DistPool workers.

For one optimizer configuration, every layout (tp, dp, sharded) of the grid, and both master
precisions, each rank builds the pieces ColossalAI would hand the optimizer (TP slices of the
full params; under ZeRO, flat fp32 chunks of the padded working param; under bf16, fp32 masters
of bf16 working params), binds them through the positional ``setup_distributed`` contract, runs
``STEPS`` steps on identical full gradients (one step has a ``None`` grad), then gathers params
and optimizer state back to full form and compares them element-wise with the unbound
(single-device) optimizer run on the full tensors in the same process.

ZeRO stages 1 and 2 hand the optimizer the same thing, a flat fp32 chunk of the padded parameter
and its gradient's chunk; they differ only in how ColossalAI reduced that gradient (all-reduce,
then slice, or reduce-scatter). So the grid has one sharded layout per (tp, dp) pair; the stages
themselves, with ColossalAI's real reductions, are the booster tests' columns
(tests/distributed/test_booster.py: ZeRO-1 and ZeRO-2 under HybridParallelPlugin and LowLevelZeroPlugin).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dist_optim import comm
from dist_optim.layout import ParamLayout, TPSplit, ZeroShard, register_tp_reader
from dist_optim.plugins.contract import setup_distributed
from dist_optim.testing import grid_groups
from tests.helpers.check import describe, excess

#: The third entry of a layout whose shards are FSDP's: every parameter flattened into one buffer
#: cut into equal pieces (``torch.chunk``), so each rank holds an unpadded range of each parameter,
#: empty for most of them (``ZeroShard.bounds``). fp32 masters only: FSDP keeps its sharded
#: parameters in full precision whatever its mixed-precision policy computes in.
FLAT = 3
#: (tp, dp, ZeRO-sharded): TP only, TP x DDP, ZeRO over 4, TP x ZeRO, TP over 4, flat ranges over 4.
LAYOUTS: list[tuple[int, int, int]] = [(2, 1, 0), (2, 2, 0), (1, 4, 1), (2, 2, 1), (4, 1, 0), (1, 4, FLAT)]
PRECISIONS = ("fp32", "bf16")
STEPS = 6
NONE_GRAD_STEP = 3  # the "row" param gets no gradient at this step
RTOL = 1e-5


@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # split dim under TP (when the size divides), None = replicated
    vocab_pad: int = 0  # trailing rows that are vocabulary padding: zero, and zero gradients


SPECS: list[Spec] = [
    Spec("col", (8, 6), 0),  # dim-0 split (Linear1D_Col)
    Spec("row", (6, 8), -1),  # last-dim split (Linear1D_Row)
    Spec("norm", (6,), None),  # replicated vector
    Spec("bias", (8,), 0),  # split vector
    Spec("emb", (12, 5), 0, vocab_pad=2),  # vocab-padded embedding
    Spec("conv", (3, 4, 3), 1),  # 3-D, split in the middle; ZeRO chunks cut the inner slabs
    Spec("padsplit", (6, 5), 0),  # numel % dp != 0 after the TP split; chunks cut rows
    Spec("padrep", (5, 3), None),  # replicated, padded, chunks cut rows
    Spec("tiny", (2,), None),  # at dp=4 two ranks hold padding only
]

#: Production-size shapes: every factor is 300-576 wide, above ``dist_optim.kernels.structured.MIN_SIZE``
#: (256), where the blocked triangle/Gram kernels take over; "colbig" splits rows under TP,
#: "rowpad" splits columns and needs ZeRO padding (301 * 225 and 301 * 450 are not multiples of 2
#: and 4), "vec" is a replicated vector.
PRODUCTION_SPECS: list[Spec] = [
    Spec("colbig", (320, 576), 0),
    Spec("rowpad", (301, 450), -1),
    Spec("vec", (576,), None),
]
#: tp=2 x dp=2 x ZeRO, dp=4 x ZeRO and flat ranges over 4 (each matrix cut across two or three ranks).
PRODUCTION_LAYOUTS: list[tuple[int, int, int]] = [(2, 2, 1), (1, 4, 1), (1, 4, FLAT)]

# The working params of this harness say their TP split dim with an attribute.
register_tp_reader(lambda t: getattr(t, "_test_tp_dim", None))


def full_params(precision: str, seed: int = 0, specs: list[Spec] = SPECS) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for spec in specs:
        t = torch.randn(spec.shape, generator=gen) * 0.5
        if spec.vocab_pad:
            t[-spec.vocab_pad :] = 0
        if precision == "bf16":
            t = t.bfloat16().float()
        out.append(t)
    return out


def full_grads(step: int, seed: int = 1, specs: list[Spec] = SPECS) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    out: list[torch.Tensor | None] = []
    for spec in specs:
        g = torch.randn(spec.shape, generator=gen) * (0.1 * (step + 1))
        if spec.vocab_pad:
            g[-spec.vocab_pad :] = 0
        out.append(None if (spec.name == "row" and step == NONE_GRAD_STEP) else g)
    return out


#: A Case kwargs key (not passed to the optimizer): extra options for a group of the 2-D params
#: only (e.g. GaLore's ``rank``); params with 3+ dims then get a group of their own.
MATRIX_GROUP = "_matrix_group"
#: A Case kwargs key (not passed to the optimizer): extra options for the group of the vectors
#: (e.g. Muon's ``use_muon=False``: they get its auxiliary AdamW).
VECTOR_GROUP = "_vector_group"


#: A Case kwargs key (not passed to the optimizer): {spec name: options}, each named parameter in a
#: group of its own with those options (options that depend on the shape, e.g. Muon's ``heads``).
PER_PARAM = "_per_param"


#: A Case kwargs key (not passed to the optimizer): QK-clip on the grid, {spec name: (attention
#: name, "q" or "k", head_dim, query heads per key head)}: those parameters are named as that
#: attention's projections and :class:`GridLogits` plays the measured logits.
QK_CLIP = "_qk_clip"
_NOT_OPTIONS = (MATRIX_GROUP, VECTOR_GROUP, PER_PARAM, QK_CLIP)


@dataclass
class GridLogits:
    """The attention logits a QK-clip case's optimizer acts on at each step, as a rank would
    measure them: per head a value in [0.5, 1.5] (``qk_clip_tau=1`` clips about half the heads),
    held whole by one data-parallel rank and halved on the others (which rank differs from head to
    head: the maxima must be max-reduced over them), and cut to the heads of this rank's TP slice
    of the query projection. The same every step, so that an optimizer rebuilt from a state dict
    sees what the original would (tests/unit/test_contract.py)."""

    roles: dict[str, tuple[str, str, int, int]]
    specs: list[Spec]
    tp: int = 1
    tp_rank: int = 0
    dp: int = 1
    dp_rank: int = 0
    sequence_group: Any = None  # the grid has no sequences

    def take(self) -> dict[str, Any]:
        from dist_optim.muon.qk_clip import HeadMaxima

        out = {}
        for index, (name, (attention, which, head_dim, group)) in enumerate(sorted(self.roles.items())):
            if which != "q":
                continue
            spec = next(sp for sp in self.specs if sp.name == name)
            heads = spec.shape[0] // head_dim
            gen = torch.Generator().manual_seed(index)
            values = 0.5 + torch.rand(heads, generator=gen, dtype=torch.float64)
            holder = (torch.arange(heads) + index) % self.dp
            values = torch.where(holder == self.dp_rank, values, values / 2).float()
            if _tp_dim(spec, self.tp) == 0:
                values = values.chunk(self.tp)[self.tp_rank]
            out[attention] = HeadMaxima(values, head_dim, group)
        return out

    def reset(self) -> None:
        pass


def qk_clip_names(opt: Any, params: list[torch.Tensor], kwargs: dict[str, Any], specs: list[Spec]) -> None:
    """Name a QK-clip case's parameters as their attention projections (:data:`QK_CLIP`)."""
    for p, spec in zip(params, specs):
        if spec.name in kwargs.get(QK_CLIP, {}):
            attention, which = kwargs[QK_CLIP][spec.name][:2]
            opt.param_names[p] = f"{attention}.{which}_proj.{'weight' if len(spec.shape) > 1 else 'bias'}"


def param_groups(params: list[torch.Tensor], kwargs: dict[str, Any], specs: list[Spec] = SPECS) -> list[dict[str, Any]]:
    """Two groups (matrices, vectors) so per-group options are exercised too; the vectors' group
    takes ``kwargs[VECTOR_GROUP]`` (a dict) where given.

    With ``kwargs[MATRIX_GROUP]`` (a dict), three: exactly-2-D params with those options, 3+-D
    params, vectors. With ``kwargs[PER_PARAM]``, the named parameters first, one group each."""
    if PER_PARAM in kwargs:
        named = kwargs[PER_PARAM]
        rest = [(p, spec) for p, spec in zip(params, specs) if spec.name not in named]
        others = {k: v for k, v in kwargs.items() if k not in (PER_PARAM, QK_CLIP)}
        groups = param_groups([p for p, _ in rest], others, [spec for _, spec in rest])
        own = [{"params": [p], **named[spec.name]} for p, spec in zip(params, specs) if spec.name in named]
        return own + [g for g in groups if g["params"]]
    # By spec, not by p.dim(): ZeRO chunks are 1-D whatever the parameter's shape.
    mats = [p for p, spec in zip(params, specs) if len(spec.shape) >= 2]
    vecs = [p for p, spec in zip(params, specs) if len(spec.shape) < 2]
    lr = kwargs.get("lr", 1e-3)
    vec_group = {"params": vecs, "lr": lr * 0.5, **kwargs.get(VECTOR_GROUP, {})}
    if MATRIX_GROUP in kwargs:
        two_d = [p for p, spec in zip(params, specs) if len(spec.shape) == 2]
        higher = [p for p, spec in zip(params, specs) if len(spec.shape) > 2]
        return [{"params": two_d, **kwargs[MATRIX_GROUP]}, {"params": higher}, vec_group]
    return [{"params": mats}, vec_group]


def make(cls: type, kwargs: dict[str, Any], params: list[torch.Tensor], specs: list[Spec] = SPECS) -> Any:
    options = {k: v for k, v in kwargs.items() if k not in _NOT_OPTIONS}
    opt = cls(param_groups(params, kwargs, specs), **options)
    if QK_CLIP in kwargs:
        qk_clip_names(opt, params, kwargs, specs)
        opt.attention_logits = GridLogits(kwargs[QK_CLIP], specs)
    return opt


def set_grads(params: list[torch.Tensor], step: int, local_grad: Any, specs: list[Spec] = SPECS) -> None:
    """Give ``params`` this rank's pieces (``local_grad(i, full_grad)``) of step ``step``'s gradients."""
    for i, (p, g) in enumerate(zip(params, full_grads(step, specs=specs))):
        p.grad = None if g is None else local_grad(i, g)


def _run(opt: Any, params: list[torch.Tensor], local_grad: Any, specs: list[Spec], skip: Collection[int] = ()) -> None:
    for step in range(STEPS):
        if step not in skip:
            set_grads(params, step, local_grad, specs)
            opt.step()


def reference(
    cls: type, kwargs: dict[str, Any], precision: str, specs: list[Spec] = SPECS, skip: Collection[int] = ()
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The single-device run on the full tensors; the steps in ``skip`` are never taken (their
    gradients are never seen)."""
    params = [p.clone() for p in full_params(precision, specs=specs)]
    opt = make(cls, kwargs, params, specs)
    with warnings.catch_warnings():
        # The single-device run inside a multi-process job warns that it is unbound: on purpose.
        warnings.simplefilter("ignore")
        _run(opt, params, lambda i, g: g.clone(), specs, skip)
    return params, ordered_state(opt, params)


def ordered_state(opt: Any, params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """full_state() is in param_groups order; return it in the order of ``params``."""
    order = [p for g in opt.param_groups for p in g["params"]]
    states = opt.full_state()
    by_id = {id(p): s for p, s in zip(order, states)}
    return [by_id[id(p)] for p in params]


def _tp_dim(spec: Spec, tp: int) -> int | None:
    if tp == 1 or spec.tp_dim is None:
        return None
    dim = spec.tp_dim % len(spec.shape)
    return dim if spec.shape[dim] % tp == 0 else None


def tp_slice(t: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    if dim is None:
        return t
    return t.chunk(tp, dim=dim)[rank]


def zero_chunk(t: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    flat = t.reshape(-1)
    pad = (-flat.numel()) % dp
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.chunk(dp)[rank]


def build(
    cls: type, kwargs: dict[str, Any], tp: int, dp: int, zero: int, precision: str, specs: list[Spec] = SPECS
) -> tuple[Any, list[torch.Tensor], list[Any], Callable[[int, torch.Tensor], torch.Tensor]]:
    """This rank's pieces (masters) and the optimizer bound to them through setup_distributed,
    their TP split dims, and ``local_grad(i, full_grad)``: this rank's piece of param i's gradient."""
    if zero == FLAT:
        return _build_flat(cls, kwargs, tp, dp, precision, specs)
    tp_group, dp_group = grid_groups(tp, dp)
    tp_rank = dist.get_rank(tp_group)
    dp_rank = dist.get_rank(dp_group)
    is_zero = zero > 0 and dp > 1
    wdtype = torch.bfloat16 if precision == "bf16" else torch.float32
    masters: list[torch.Tensor] = []
    workings: list[torch.Tensor] = []
    shard_map: dict[int, torch.Tensor] = {}
    padding_map: dict[int, int] = {}
    master_to_working: dict[int, torch.Tensor] = {}
    dims = [_tp_dim(spec, tp) for spec in specs]
    for full, dim in zip(full_params(precision, specs=specs), dims):
        working = torch.nn.Parameter(tp_slice(full, dim, tp, tp_rank).to(wdtype).clone())
        working._test_tp_dim = dim  # type: ignore[attr-defined]
        workings.append(working)
        if is_zero:
            master = zero_chunk(working.detach().float(), dp, dp_rank).clone()
            shard_map[id(master)] = working
            padding_map[id(working)] = (-working.numel()) % dp
        elif precision == "bf16":
            master = working.detach().float().clone()
            master_to_working[id(master)] = working
        else:
            master = working
        masters.append(master)
    opt = make(cls, kwargs, masters, specs)
    _place_logits(opt, tp, tp_rank, dp, dp_rank)
    setup_distributed(
        opt,
        tp_group,
        dp_group,
        shard_map,
        padding_map,
        is_zero,
        **({"master_to_working": master_to_working} if master_to_working else {}),
    )

    def local_grad(i: int, g: torch.Tensor) -> torch.Tensor:
        piece = tp_slice(g, dims[i], tp, tp_rank)
        return zero_chunk(piece, dp, dp_rank).clone() if is_zero else piece.clone()

    return opt, masters, dims, local_grad


def _place_logits(opt: Any, tp: int, tp_rank: int, dp: int, dp_rank: int) -> None:
    """Tell a QK-clip case's :class:`GridLogits` which rank of the grid it plays."""
    logits = getattr(opt, "attention_logits", None)
    if isinstance(logits, GridLogits):
        logits.tp, logits.tp_rank, logits.dp, logits.dp_rank = tp, tp_rank, dp, dp_rank


def flat_bounds(numels: list[int], size: int) -> list[tuple[int, ...]]:
    """Each parameter's :class:`~dist_optim.layout.ZeroShard` ``bounds`` when parameters of
    ``numels`` elements are laid end to end in one buffer cut by ``torch.chunk`` into ``size``
    pieces (FSDP's flat parameter, without its alignment padding)."""
    total = sum(numels)
    width = -(-total // size)
    out, offset = [], 0
    for n in numels:
        out.append(tuple(min(max(r * width - offset, 0), n) for r in range(size + 1)))
        offset += n
    return out


def _build_flat(
    cls: type, kwargs: dict[str, Any], tp: int, dp: int, precision: str, specs: list[Spec]
) -> tuple[Any, list[torch.Tensor], list[Any], Callable[[int, torch.Tensor], torch.Tensor]]:
    """:func:`build` for the :data:`FLAT` layout: TP slices of the parameters, flat ranges over dp."""
    tp_group, dp_group = grid_groups(tp, dp)
    tp_rank, dp_rank = dist.get_rank(tp_group), dist.get_rank(dp_group)
    dims = [_tp_dim(spec, tp) for spec in specs]
    fulls = full_params(precision, specs=specs)
    tp_split = [None if d is None else TPSplit(d, tp, tp_rank, tp_group) for d in dims]
    layouts = [ParamLayout(tuple(f.shape), split) for f, split in zip(fulls, tp_split)]
    bounds = flat_bounds([lay.local_numel for lay in layouts], dp)
    layouts = [dataclasses.replace(lay, zero=ZeroShard(dp, dp_rank, 0, dp_group, b)) for lay, b in zip(layouts, bounds)]
    masters = [lay.take_local(f.float()) for lay, f in zip(layouts, fulls)]
    opt = make(cls, kwargs, masters, specs)
    _place_logits(opt, tp, tp_rank, dp, dp_rank)
    opt.bind(dict(zip(masters, layouts)), dp_group=dp_group, tp_group=tp_group)

    def local_grad(i: int, g: torch.Tensor) -> torch.Tensor:
        return layouts[i].take_local(g)

    return opt, masters, dims, local_grad


def distributed(
    cls: type, kwargs: dict[str, Any], tp: int, dp: int, zero: int, precision: str, specs: list[Spec] = SPECS
) -> tuple[Any, list[torch.Tensor], list[Any]]:
    """Build this rank's pieces, bind through setup_distributed, run the steps."""
    opt, masters, dims, local_grad = build(cls, kwargs, tp, dp, zero, precision, specs)
    _run(opt, masters, local_grad, specs)
    return opt, masters, dims


def full_result(opt: Any, masters: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """The full params and full optimizer state (in the order of ``masters``) of a bound run (collective)."""
    full = comm.gather_full([(opt.layout(p), p) for p in masters])
    return full, ordered_state(opt, masters)


def _mismatch(actual: Any, expected: torch.Tensor) -> str | None:
    """Why ``actual`` is not element-wise within RTOL of ``expected`` (tests/helpers/check.py), or None."""
    if not isinstance(actual, torch.Tensor):
        return f"{type(actual).__name__} where a tensor was expected"
    e = excess(actual, expected, RTOL)
    return None if e <= 1 else f"{e:.3g}x the element-wise tolerance; {describe(actual, expected)}"


def compare(
    label: str,
    params: list[torch.Tensor],
    states: list[dict[str, Any]],
    ref_params: list[torch.Tensor],
    ref_states: list[dict[str, Any]],
    specs: list[Spec] = SPECS,
) -> list[str]:
    failures = []
    for spec, p, rp, s, rs in zip(specs, params, ref_params, states, ref_states):
        why = _mismatch(p, rp)
        if why is not None:
            failures.append(f"{label} param {spec.name}: {why}")
        if set(s) != set(rs):
            failures.append(f"{label} state {spec.name}: keys {sorted(s)} != {sorted(rs)}")
            continue
        for key in rs:
            a, b = s[key], rs[key]
            if isinstance(b, torch.Tensor):
                why = _mismatch(a, b)
                if why is not None:
                    failures.append(f"{label} state {spec.name}.{key}: {why}")
            elif a != b:
                failures.append(f"{label} state {spec.name}.{key}: {a!r} != {b!r}")
    return failures


def parity_worker(
    cls: type,
    kwargs: dict[str, Any],
    layouts: list[tuple[int, int, int]] | None = None,
    precisions: tuple[str, ...] = PRECISIONS,
    specs: list[Spec] = SPECS,
) -> list[str]:
    """Run the grid on this rank; return a list of mismatches (empty = parity)."""
    failures: list[str] = []
    for precision in precisions:
        ref_params, ref_states = reference(cls, kwargs, precision, specs)
        for tp, dp, zero in layouts or LAYOUTS:
            if zero == FLAT and precision != "fp32":
                continue
            label = f"[tp={tp} dp={dp} zero={zero} {precision}]"
            opt, masters, _ = distributed(cls, kwargs, tp, dp, zero, precision, specs)
            failures += compare(label, *full_result(opt, masters), ref_params, ref_states, specs)
    return failures
