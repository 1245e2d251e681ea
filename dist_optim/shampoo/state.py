"""Typed state of one block, its flat form in ``optimizer.state``, and reused scratch memory.

The preconditioners read and update a :class:`BlockState`. ``optimizer.state[p]`` (what torch's
``state_dict``, ZeRO's sharded state and the checkpoints serialise) holds the same tensors under
flat keys ``"block<i>.<name>"`` in the order of :func:`block_spec`: ``exp_avg`` (SOAP without
grafting: ``exp_avg_eigen``), ``graft_sq``, ``factor<k>``, ``root<k>`` (Shampoo), ``basis<k>``
(SOAP, and Shampoo with ``root_inverse="warm"``), ``failures``, ``exp_avg_sq`` (SOAP).
:meth:`BlockState.flat` writes that form and :meth:`BlockState.of` views it (the same tensors,
updated in place); nothing else spells a key.

With ``use_symmetric_packing`` the symmetric matrices (factors, roots) are kept as packed lower
triangles, ``d (d + 1) / 2`` elements (:func:`dist_optim.kernels.structured.pack_lower`): a factor's
kept triangle (:func:`~dist_optim.shampoo.blocking.kept_triangle`), a root's lower one. The math
never sees that form: the block's forms (:mod:`dist_optim.shampoo.preconditioner.forms`) give its
matrices whole, in reused scratch memory, and pack back what a step changed. Every stored symmetric matrix, packed or
not, is the mirror of that triangle (factors mirrored at each refresh, roots when computed), so
packing loses nothing: the packed run equals the unpacked one bit for bit.

With ``optim_bits=8`` a block of at least ``min_8bit_size`` elements keeps its moments
(:data:`EIGHT_BIT_MOMENTS`; Shampoo's first moment only with grafting: :func:`keeps_8bit`) as
bitsandbytes' block-wise 8-bit codes, each with
``<name>_absmax`` (one fp32 absmax per 256 consecutive elements of the block, flattened): the
math runs on their fp32 values (:func:`step_state`, through :class:`dist_optim.states.bnb.Batch8bit`),
stored again after the step. A moment saved with the other ``optim_bits`` is carried over there.

With ``preconditioner_bits`` 8 or 4 the eigenvector matrices of blocks of at least 2 dims
(:func:`quantises_bases`) are kept block-wise quantised (:mod:`dist_optim.states.lowbit`): ``basis<k>``
holds the codes of ``Q_k`` (1-D uint8; SOAP's bases, and for Shampoo the eigenvectors of the
damped factor, in place of ``root<k>``) and ``basis<k>_absmax`` their block absmax, and Shampoo
keeps ``spectrum<k>``, the root's eigenvalues ``(lam + epsilon)^-alpha`` (length ``d``,
``preconditioner_dtype``): ``R_k = Q_k diag(s_k) Q_k^T``. The block's forms give the matrices
whole (dequantised, then rectified by one Björck step) in scratch and quantise a refreshed one
back. The factors stay in ``preconditioner_dtype`` (packed with ``use_symmetric_packing``): each
step adds a small increment to them, which a 4- or 8-bit code of the sum would mostly round away.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels import structured
from ..kernels.replay import replayable
from ..layout import whole_layout
from ..states import bnb, codecs
from .blocking import Block, kept_triangle
from .momentum import MOMENTUM
from .options import SQUARED_GRAFTING_TYPES, uses_warm_refresh
from .scratch import ALIGN_BYTES, Scratch

__all__ = [
    "BlockState",
    "block_spec",
    "block_prefix",
    "keeps_moment_in_eigenbasis",
    "keeps_saved_dtype",
    "non_block_entries",
    "full_block_entries",
    "checked_block_entries",
    "initial_state",
    "ALIGN_BYTES",
    "Scratch",
    "EIGHT_BIT_MOMENTS",
    "MOMENTS",
    "STATE",
    "basis_codec",
    "keeps_8bit",
    "step_state",
    "carry_over",
    "check_loaded_forms",
    "quantises_bases",
    "mirror_whole_factors",
]

#: The moments that ``optim_bits=8`` keeps as bitsandbytes' 8-bit codes (first moments: its signed
#: map; second moments: its unsigned one).
MOMENTS = (
    codecs.Entry("exp_avg", codecs.BNB_SIGNED),
    codecs.Entry("exp_avg_eigen", codecs.BNB_SIGNED),
    codecs.Entry("graft_sq", codecs.BNB_UNSIGNED),
    codecs.Entry("exp_avg_sq", codecs.BNB_UNSIGNED),
)
EIGHT_BIT_MOMENTS = {e.name: e.codec.signed for e in MOMENTS}

#: Every entry of a Shampoo parameter's state and the codec its option selects: the momentum
#: (``optim_bits``), the blocks' moments (``optim_bits``), factors and roots (packed lower
#: triangles: ``use_symmetric_packing``), eigenvectors (codes: ``preconditioner_bits``, whose
#: width :func:`basis_codec` gives), spectra and failure counters (plain). The pattern is the one
#: rule that parses a key: ``[block<i>.]<name>[<k>][_absmax]``.
STATE = codecs.StateSpec(
    (
        codecs.Entry("step", codecs.PLAIN),
        MOMENTUM,
        *MOMENTS,
        codecs.Entry("factor", codecs.PACKED_SYMMETRIC),
        codecs.Entry("root", codecs.PACKED_SYMMETRIC),
        codecs.Entry("basis", codecs.LowBit(4)),
        codecs.Entry("spectrum", codecs.PLAIN),
        codecs.Entry("failures", codecs.PLAIN),
    ),
    pattern=rf"(?:block\d+\.)?(?P<name>[a-z_]+?)(?P<index>\d+)?(?P<absmax>{codecs.ABSMAX})?",
)

#: Names (before their dim index) of the preconditioner matrices: :meth:`DistributedShampoo.state_bytes`.
_MATRICES = ("factor", "root", "basis", "spectrum")


@replayable
def identity(side: int, dtype: torch.dtype, device: torch.device, packed: bool) -> torch.Tensor:
    """The identity of ``side``, whole or as a packed lower triangle: a block's initial roots and
    bases. Replayable (:mod:`dist_optim.kernels.replay`): a simulated 70B step creates thousands of blocks of
    a few sides, and a meta ``eye`` dispatches several operators (``time python -m dist_optim.plan
    --model llama-70b --tp 8 --dp 8 --zero 1 --optimizer shampoo``)."""
    eye = torch.eye(side, dtype=dtype, device=device)
    return codecs.PACKED_SYMMETRIC.pack(eye) if packed else eye


def block_prefix(index: int) -> str:
    """The flat keys of block ``index`` of a parameter start with this."""
    return f"block{index}."


def block_spec(block: Block, group: dict[str, Any], dtype: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
    """Names (after :func:`block_prefix`), shapes and dtypes of one block's state, in the order of
    its flat form; the same on every rank. ``dtype``: the moments' (the gradient's)."""
    pdt = group["preconditioner_dtype"]
    soap = group["eigenvalue_correction"]
    packed = group["use_symmetric_packing"]

    sym_codec = codecs.PACKED_SYMMETRIC if packed else codecs.PLAIN

    def sym(d: int) -> tuple[int, ...]:
        return sym_codec.stored("", (d, d), pdt)[0][1]

    def moment(name: str, dt: torch.dtype) -> list[tuple[str, tuple, torch.dtype]]:
        codec = STATE.entry(name).codec if keeps_8bit(block, group, name) else codecs.PLAIN
        return list(codec.stored(name, tuple(block.shape), dt))

    spec: list[tuple[str, tuple, torch.dtype]] = []
    if group["betas"][0] > 0:
        spec += moment("exp_avg_eigen" if keeps_moment_in_eigenbasis(group) else "exp_avg", dtype)
    if isinstance(group["grafting_config"], SQUARED_GRAFTING_TYPES):
        spec += moment("graft_sq", dtype)
    bits = group["preconditioner_bits"] if quantises_bases(block, group) else 32
    if block.precondition:
        spec += [(f"factor{k}", sym(d), pdt) for k, d in enumerate(block.shape)]
        if not soap and bits == 32:
            spec += [(f"root{k}", sym(d), pdt) for k, d in enumerate(block.shape)]
        if bits < 32:  # quantised eigenvectors (Shampoo: of the roots, with their eigenvalues)
            # Every dim's codes, then every dim's absmax: the saved order.
            stored = [basis_codec(bits).stored(f"basis{k}", (d, d), pdt) for k, d in enumerate(block.shape)]
            spec += [codes for codes, _ in stored] + [absmax for _, absmax in stored]
            if not soap:
                spec += [(f"spectrum{k}", (d,), pdt) for k, d in enumerate(block.shape)]
        elif soap or uses_warm_refresh(group):  # SOAP's bases; the eigenvectors a warm root refresh starts from
            spec += [(f"basis{k}", (d, d), pdt) for k, d in enumerate(block.shape)]
        spec.append(("failures", (), torch.float32))
    if soap:
        spec += moment("exp_avg_sq", pdt)
    return spec


def _parsed(key: str) -> tuple[str | None, int, bool]:
    """A key's entry name (None: not one of :data:`STATE`), its dim index (-1: none) and whether it
    is a quantised entry's absmax."""
    parsed = STATE.parse(key)
    if parsed is None:
        return None, -1, False
    entry, index, is_absmax = parsed
    return entry.name, -1 if index is None else index, is_absmax


def basis_codec(bits: int) -> codecs.LowBit:
    """How eigenvector matrices are stored at ``preconditioner_bits`` 8 or 4: codes of the whole
    matrix (an eigenvector matrix is not symmetric) and ``basis<k>_absmax``."""
    return codecs.LowBit(bits)


def keeps_8bit(block: Block, group: dict[str, Any], name: str) -> bool:
    """Whether ``block`` keeps its moment ``name`` in 8 bits: ``optim_bits=8`` and at least
    ``min_8bit_size`` elements (bitsandbytes decides per tensor, we per block, the unit a block's
    owner holds whole on every layout), except Shampoo's first moment without grafting.

    That one is multiplied by the roots, whose eigenvalues ``(lam + epsilon)^(-1/r)`` on the
    factors' (near-)null space exceed those on the gradients' span by up to ``(lam_max /
    epsilon)^(1/r)``. The exact moment lies in that span (a sum of past gradients); its 8-bit
    error does not, so the roots amplify the error by that ratio, and without grafting nothing
    bounds the step (tests/unit/test_shampoo_8bit.py has the least-squares run that diverged).
    Grafting rescales the step to its own element-wise direction's norm; SOAP keeps this moment
    in the eigenbasis (``exp_avg_eigen``), where each coordinate's error stays relative to itself."""
    if not codecs.EightBit.of(group).keeps(math.prod(block.shape)):
        return False
    return name != "exp_avg" or group["grafting_config"] is not None


def quantises_bases(block: Block, group: dict[str, Any]) -> bool:
    """Whether ``block`` keeps its eigenvector matrices quantised: ``preconditioner_bits`` 8 or 4,
    and a block of at least 2 dims. A vector's factor gains one rank a step, so for its first
    ``d`` steps most of its eigenvalues are ``epsilon``'s, where the root's are largest: the
    quantisation error of those eigenvectors, times the root's eigenvalue spread, swamps the
    direction (the update then barely points where the 32-bit one does), and vectors' matrices are
    a small part of the state (``python -m dist_optim.plan`` prints a layout's state bytes)."""
    return group["preconditioner_bits"] < 32 and block.order >= 2


def keeps_moment_in_eigenbasis(group: dict[str, Any]) -> bool:
    """Whether SOAP keeps its first moment in the eigenbasis (``exp_avg_eigen``, rotated at each
    refresh, as Vyas et al.'s code and heavyball do: two rotations a step instead of three). With
    grafting it stays in the parameter's basis (``exp_avg``), where the grafting direction needs it."""
    return bool(group["eigenvalue_correction"]) and group["grafting_config"] is None


def keeps_saved_dtype(key: str) -> bool:
    """Whether a flat key's saved tensor is restored in its saved dtype (preconditioner matrices in
    ``preconditioner_dtype``, SOAP's second moment, failure counters) rather than cast to its
    parameter's dtype as torch's loader does: the one rule read from the serialised form."""
    parsed = STATE.parse(key)
    if parsed is None:
        return False
    entry, _, is_absmax = parsed
    return entry.name in _MATRICES or entry.name in ("exp_avg_sq", "failures") or is_absmax


def initial_state(
    p: torch.Tensor,
    group: dict[str, Any],
    dtype: torch.dtype,
    blocks: list[Block],
    owned: list[bool],
    momentum_8bit: bool = False,
) -> dict[str, torch.Tensor]:
    """A parameter's first state, in flat form: ``step``, ``momentum_buffer`` (with momentum; an
    8-bit one, ``momentum_8bit``, is made by :func:`~dist_optim.shampoo.momentum.read_momenta` at the
    first update) and the state of the blocks this rank owns (``owned``), the moments in ``dtype``."""
    out = {"step": torch.zeros((), dtype=torch.float32)}
    if group["momentum"] > 0 and not momentum_8bit:
        out["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    for i, (block, mine) in enumerate(zip(blocks, owned)):
        if mine:
            out.update(BlockState.create(block, group, dtype, p.device).flat(block_prefix(i)))
    return out


def non_block_entries(state: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's state without its blocks' (``step``, ``momentum_buffer``)."""
    return {k: v for k, v in state.items() if not k.startswith("block")}


def full_block_entries(
    state: Mapping[str, Any],
    index: int,
    block: Block,
    group: dict[str, Any],
    dtype: torch.dtype,
    owned: bool,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Block ``index``'s flat entries for a full-form state: copies where ``owned``, else empty
    tensors of the :func:`block_spec` shapes and dtypes (moments: those of the state's own moments,
    else ``dtype``), to be filled by the owner."""
    prefix = block_prefix(index)
    moments = BlockState.of(state, prefix, block.order).moment_dtype(dtype)
    return {
        prefix + name: state[prefix + name].clone() if owned else torch.empty(shape, dtype=dt, device=device)
        for name, shape, dt in block_spec(block, group, moments)
    }


def checked_block_entries(
    state: Mapping[str, Any],
    index: int,
    block: Block,
    group: dict[str, Any],
    param: torch.Tensor,
    full_shape: tuple[int, ...],
) -> dict[str, torch.Tensor]:
    """Block ``index``'s flat entries of a full-form state, on ``param``'s device, after checking
    that it has every entry with the shapes of this blocking (a checkpoint saved with other blocking
    options is refused); its moments may be 8-bit codes or not, whatever ``optim_bits`` gives."""
    out: dict[str, torch.Tensor] = {}
    # Moments saved with the other optim_bits are carried over at the next step (step_state):
    # the entries to find are those of the width each was saved in (codes: the moment's shape).
    prefix = block_prefix(index)
    spec: list[tuple[str, tuple, torch.dtype]] = []
    for entry in block_spec(block, dict(group, optim_bits=32), param.dtype):
        spec.append(entry)
        value = state.get(prefix + entry[0])
        if entry[0] in EIGHT_BIT_MOMENTS and STATE.entry(entry[0]).holds(state, prefix):
            spec.append(STATE.entry(entry[0]).codec.stored(entry[0], tuple(block.shape), entry[2])[1])
    for name, shape, _ in spec:
        key = block_prefix(index) + name
        value = state.get(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
            raise ValueError(
                f"load_full_state: state {key!r} of a parameter of full shape {full_shape} should be a "
                f"tensor of shape {tuple(shape)}, got {got!r}; was it saved with other blocking options "
                "(max_preconditioner_dim, merge_small_dims, eigenvalue_correction, grafting, use_symmetric_packing, "
                "preconditioner_bits), "
                "or, for SOAP without "
                "grafting, by an earlier dist_optim that kept the first moment in the parameter's basis ('exp_avg')?"
            )
        out[key] = value.to(param.device)
    return out


@dataclass
class BlockState:
    """What one block's owner keeps (None / empty where the options need no such state)."""

    exp_avg: torch.Tensor | None = None  # M, the first moment (betas[0] > 0)
    exp_avg_eigen: torch.Tensor | None = None  # SOAP's M in the eigenbasis instead (keeps_moment_in_eigenbasis)
    graft_sq: torch.Tensor | None = None  # V of AdaGrad / RMSprop / Adam grafting
    factors: list[torch.Tensor] = dataclasses.field(default_factory=list)  # L_k (large ones: one triangle kept)
    roots: list[torch.Tensor] = dataclasses.field(default_factory=list)  # R_k (Shampoo)
    bases: list[torch.Tensor] = dataclasses.field(default_factory=list)  # Q_k (SOAP; a warm Shampoo refresh's)
    basis_absmax: list[torch.Tensor] = dataclasses.field(default_factory=list)  # of quantised Q_k
    spectra: list[torch.Tensor] = dataclasses.field(default_factory=list)  # s_k of R_k = Q_k diag(s_k) Q_k^T
    failures: torch.Tensor | None = None  # discarded roots / basis refreshes
    exp_avg_sq: torch.Tensor | None = None  # S, SOAP's second moment in the eigenbasis
    absmax: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # of the 8-bit moments, by name

    @classmethod
    def of(cls, flat: Mapping[str, Any], prefix: str, order: int) -> BlockState:
        """A view of the block state held in ``flat`` under keys ``prefix + name`` (the same tensors)."""
        get = flat.get

        def mats(name: str, suffix: str = "") -> list[torch.Tensor]:
            first = get(f"{prefix}{name}0{suffix}")
            return [] if first is None else [first] + [flat[f"{prefix}{name}{k}{suffix}"] for k in range(1, order)]

        return cls(
            exp_avg=get(prefix + "exp_avg"),
            exp_avg_eigen=get(prefix + "exp_avg_eigen"),
            graft_sq=get(prefix + "graft_sq"),
            factors=mats("factor"),
            roots=mats("root"),
            bases=mats("basis"),
            basis_absmax=mats("basis", codecs.ABSMAX),
            spectra=mats("spectrum"),
            failures=get(prefix + "failures"),
            exp_avg_sq=get(prefix + "exp_avg_sq"),
            absmax={e.name: flat[k] for e in MOMENTS if (k := codecs.absmax_key(prefix + e.name)) in flat},
        )

    @classmethod
    def create(cls, block: Block, group: dict[str, Any], dtype: torch.dtype, device: torch.device) -> BlockState:
        """A block's initial state: zeros, identity roots and bases (quantised: their exact codes),
        unit spectra."""
        values: dict[str, torch.Tensor] = {}
        quantised = quantises_bases(block, group)
        for name, shape, dt in block_spec(block, group, dtype):
            entry, k, is_absmax = _parsed(name)
            if entry == "basis" and quantised:
                if not is_absmax:  # the absmax is made with its codes
                    eye = torch.eye(block.shape[k], device=device)
                    values[name], values[name + codecs.ABSMAX] = basis_codec(group["preconditioner_bits"]).quantize(eye)
            elif entry == "spectrum":
                values[name] = torch.ones(shape, dtype=dt, device=device)
            elif entry in ("root", "basis"):
                values[name] = identity(block.shape[k], dt, device, len(shape) != 2)
            else:
                values[name] = torch.zeros(shape, dtype=dt, device=device)
        return cls.of(values, "", block.order)

    def flat(self, prefix: str) -> dict[str, torch.Tensor]:
        """The flat form, keys in :func:`block_spec` order."""
        out: dict[str, torch.Tensor] = {}

        def put(name: str) -> None:
            value = getattr(self, name)
            if value is not None:
                out[prefix + name] = value
            if name in self.absmax:
                out[codecs.absmax_key(prefix + name)] = self.absmax[name]

        for name in ("exp_avg", "exp_avg_eigen", "graft_sq"):
            put(name)
        for name, mats in (
            ("factor", self.factors),
            ("root", self.roots),
            ("basis", self.bases),
            ("basis", self.basis_absmax),
            ("spectrum", self.spectra),
        ):
            tail = codecs.ABSMAX if mats is self.basis_absmax else ""
            out.update((f"{prefix}{name}{k}{tail}", m) for k, m in enumerate(mats))
        for name in ("failures", "exp_avg_sq"):
            put(name)
        return out

    @property
    def matrices(self) -> list[torch.Tensor]:
        """The preconditioner: factors, roots, bases (quantised: codes, absmax), spectra."""
        return self.factors + self.roots + self.bases + self.basis_absmax + self.spectra

    def moment_dtype(self, default: torch.dtype) -> torch.dtype:
        """The dtype of the moments (the gradient's when the state was made), ``default`` without any."""
        for value in (self.exp_avg, self.exp_avg_eigen, self.graft_sq):
            if value is not None:
                return value.dtype
        return default


def step_state(
    state: dict[str, Any],
    prefix: str,
    block: Block,
    group: dict[str, Any],
    dtype: torch.dtype,
    batch: bnb.Batch8bit,
) -> BlockState:
    """The typed state of the block whose flat keys start with ``prefix`` for a step on its owner,
    its moments as the step updates them. A block that keeps 8-bit moments (:func:`keeps_8bit`)
    gets their fp32 values (SOAP's second moment in ``preconditioner_dtype``, where it is kept at
    32 bits), new tensors from ``batch`` (:meth:`~dist_optim.states.bnb.Batch8bit.read`), to be
    stored quantised by ``batch.store()`` after the step; bitsandbytes' 8-bit optimizers too
    update the fp32 values and store them quantised again. The owner holds the block whole, so
    its quantisation blocks are the block's own elements and storing needs no collective.

    A moment saved with the other ``optim_bits`` is carried over, as every optimizer's: a 32-bit
    one read by an 8-bit block is quantised at this step (its values, not zeros, are what the
    step updates), an 8-bit one in a block that keeps 32 bits dequantised into the state, in
    ``dtype`` (the gradient's, as a new state's moments; SOAP's second moment in
    ``preconditioner_dtype``)."""
    layout = whole_layout(tuple(block.shape))
    values: dict[str, torch.Tensor] = {}
    for entry in MOMENTS:
        name, key = entry.name, prefix + entry.name
        value = state.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if keeps_8bit(block, group, name):
            values[name] = entry.codec.read(batch, state, key, layout, value, _moment_dtype(name, group, torch.float32))
        else:
            entry.codec.to_plain(batch, state, key, layout, value.device, _moment_dtype(name, group, dtype))
    bs = BlockState.of(state, prefix, block.order)
    if not values:
        return bs
    out = dataclasses.replace(bs, absmax={})
    for name, value in values.items():
        setattr(out, name, value)
    return out


def carry_over(state: dict[str, Any], prefix: str, block: Block, group: dict[str, Any], dtype: torch.dtype) -> None:
    """Bring the moments of a block this rank owns that were saved with the other ``optim_bits``
    to the width its group keeps (as :func:`step_state` and a store would, without a step; the
    others are left as they are): a rank exports its state in the form the other ranks expect,
    where such a state was loaded and no step has been taken since."""
    layout = whole_layout(tuple(block.shape))
    batch = bnb.Batch8bit()
    for entry in MOMENTS:
        name, key = entry.name, prefix + entry.name
        value = state.get(key)
        eight = keeps_8bit(block, group, name)
        if not isinstance(value, torch.Tensor) or entry.codec.holds(value) == eight:
            continue
        if eight:
            entry.codec.read(batch, state, key, layout, value)
        else:
            entry.codec.to_plain(batch, state, key, layout, value.device, _moment_dtype(name, group, dtype))
    batch.store()


def _moment_dtype(name: str, group: dict[str, Any], dtype: torch.dtype) -> torch.dtype:
    """SOAP's second moment is kept in ``preconditioner_dtype``, the other moments in ``dtype``."""
    return group["preconditioner_dtype"] if name == "exp_avg_sq" else dtype


def mirror_whole_factors(block_states: Iterable[tuple[Any, Block, BlockState]]) -> None:
    """Mirror every whole (not packed) factor's kept triangle, the only one its updates keep
    current (:func:`dist_optim.kernels.structured.gram_update_`), so that exported state is symmetric."""
    for _, block, bs in block_states:
        for k, factor in enumerate(bs.factors):
            if factor.dim() == 2:
                structured.mirror_lower_(kept_triangle(factor, block.order, k))


def check_loaded_forms(saved: Mapping[str, Any], groups: list[dict[str, Any]]) -> None:
    """Refuse, before anything is loaded, a state dict whose matrices are not in the form its param
    groups give (packed triangles or whole matrices: ``use_symmetric_packing``; quantised
    eigenvectors or fp roots and bases: ``preconditioner_bits``). A group saved before an option
    existed takes this optimizer's value (the base's loader), which may not be the form its state
    was saved in. Moments and momentum saved with the other ``optim_bits`` (or ``min_8bit_size``)
    are not refused: they are carried over at the next step (:func:`step_state`,
    :func:`dist_optim.shampoo.momentum.read_momenta`)."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("param_groups"), list):
        return  # the base's loader names what is wrong
    for built, group in zip(groups, saved["param_groups"]):
        options = {**built, **group}
        for pid in group.get("params", []):
            state = saved.get("state", {}).get(pid, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    _check_form(key, value, options, f"{key.split('.')[0]}.factor1" in state)


def _check_form(key: str, value: torch.Tensor, group: Mapping[str, Any], matrix_block: bool) -> None:
    entry, _, is_absmax = _parsed(key)
    packed = group["use_symmetric_packing"]
    if key.startswith("block") and entry in ("factor", "root") and (value.dim() == 1) != packed:
        raise ValueError(
            f"load_state_dict: state {key!r} is {'a packed triangle' if value.dim() == 1 else 'a whole matrix'} "
            f"where the param group has use_symmetric_packing={packed}; build the optimizer with "
            f"use_symmetric_packing={value.dim() == 1} to load it"
        )
    bits = group["preconditioner_bits"] if matrix_block else 32  # a vector's stay whole: quantises_bases
    if key.startswith("block") and entry in ("root", "basis") and not is_absmax:
        codes = codecs.quantized(value)
        if codes != (bits < 32):
            fix = "the preconditioner_bits it was saved with (8 or 4)" if codes else "preconditioner_bits=32"
            raise ValueError(
                f"load_state_dict: state {key!r} is {'quantised codes' if codes else 'in ' + str(value.dtype)} where "
                f"the param group has preconditioner_bits={bits}; build the optimizer with {fix} to load it"
            )
