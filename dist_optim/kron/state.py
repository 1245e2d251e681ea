"""What Kron keeps per parameter in ``optimizer.state`` (what ``state_dict``, ZeRO's sharded state
and the checkpoints serialise), and the one place that spells its keys.

* ``step``: a CPU float tensor (torch's convention; kron_torch: the same), on every rank;
* ``momentum_buffer``: the parameter's shape and local form (its TP slice / ZeRO chunk;
  kron_torch: the merged shape), dtype ``mu_dtype`` or the parameter's; with ``optim_bits=8``
  (tensors of at least ``min_8bit_size`` elements) uint8 codes of that shape plus
  ``momentum_buffer_absmax``, the fp32 absmax of every block of the full tensor, replicated
  (:mod:`dist_optim.kron.momentum`);
* ``Q_0, Q_1, ...``: the factors of :class:`~dist_optim.kron.structure.FactorPlan`, full, in
  ``precond_dtype``, on the parameter's owner only (kron_torch: a list ``Q`` plus einsum strings).
  With ``use_symmetric_packing`` an upper-triangular factor ``(n, n)`` is kept as its packed upper
  triangle, 1-D of ``n (n + 1) / 2`` elements (:func:`dist_optim.kernels.structured.pack_upper`); diagonal
  factors are vectors either way. The math never sees that form: :func:`whole_factors` unpacks
  the factors of one parameter into reused scratch memory (:class:`FactorScratch`), strict lower
  triangle exactly zero as every unpacked factor keeps it (the identity it starts from and
  ``Q - triu(D) Q`` keep it), and :func:`store_whole` packs back what a step changed: packing
  loses nothing, the packed run equals the unpacked one bit for bit.
* with ``preconditioner_bits=8`` a triangular factor is kept block-wise quantised
  (:mod:`dist_optim.states.lowbit`, the package's one quantiser; Wang et al. 2024, "4-bit Shampoo",
  arXiv:2405.18144, quantise preconditioner matrices the same way): ``Q_k`` the uint8 codes of its
  packed triangle (with packing) or of the whole flattened matrix, ``Q_k_absmax`` one fp32 absmax
  per block of 256. The same mechanism: :func:`whole_factors` dequantises into the scratch, the
  step's math is unchanged, :func:`store_whole` quantises back only what a step changed (update
  and balancing steps); steps that only precondition read the codes and write nothing. The
  quantiser's exact zero keeps the unpacked strict lower triangle exactly zero. Diagonal factors
  (vectors, O(n): 0.13 MB for a 32000-row embedding, whose 4096-side triangle is 34 MB packed in
  fp32) stay in ``precond_dtype``: quantising them would save almost nothing and would tie the
  precision of each dim's scale to the largest in its block.

  The rounding is stochastic (:mod:`dist_optim.states.lowbit`: with ``y = x / absmax * 127``, the code
  ``floor(y) + 127 + [u < y - floor(y)]``, up with probability the fraction). Kron's fit
  multiplies ``Q`` by ``I - step`` with ``|step| <= precond_lr`` each update, and part of an
  update is below half a code (1/254 of its block's absmax): rounded to nearest such a change
  returns to the old code every time, a bias toward no change that ends far above full
  precision's held-out loss on the tiny Llama; rounded stochastically the stored factor equals
  the fitted one in expectation and the small changes accumulate, and the run ends level with
  full precision (bench/compact_quality.py, docs/benchmarks.md). The uniforms ``u`` are
  ``torch.rand`` over the stored elements, factor after factor in dim order, from a generator
  seeded by the BLAKE2b
  digest of ``"round|<seed>|<parameter key>|<parameter step>"``
  (:meth:`~dist_optim.kron.randomness.KronRandomness.rounding_generator`; the key as the
  per-parameter probes', whatever ``probe_rng``): the same on every layout, and a function of
  the state, so a resumed run rounds as the uninterrupted one with no more state saved. The
  initial factors (multiples of the identity: zeros and absmax) quantise exactly and are stored
  rounded to nearest. The deviation from Li's PSGD and kron_torch (factors in
  ``precond_dtype``): each fit's result is rounded stochastically to the codes and the next step
  starts from the rounded factor. Not guarded: a diagonal entry of a triangular factor within a
  code of zero (its block's absmax over 127) may round to zero and make the factor singular (the
  triangular solve of the fit); not seen in the training bench.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..states import codecs
from .options import precond_dtype
from .structure import FactorPlan
from .variant import LOWER_BOUND, heavy

__all__ = [
    "check_loaded_forms",
    "MOMENTUM",
    "MOMENTUM_ENTRY",
    "init_param_state",
    "factor_key",
    "is_factor_key",
    "has_factors",
    "factors",
    "store_factors",
    "without_factors",
    "keeps_saved_dtype",
    "FactorForm",
    "factor_form",
    "absmax_key",
    "stored_specs",
    "FactorScratch",
    "whole_factors",
    "store_whole",
    "check_factor_shapes",
]


#: The momentum's key (its 8-bit absmax: ``MOMENTUM + "_absmax"``).
MOMENTUM = "momentum_buffer"
#: The momentum, bitsandbytes' signed 8-bit codes with ``optim_bits=8``.
MOMENTUM_ENTRY = codecs.Entry(MOMENTUM, codecs.BNB_SIGNED)
#: The one rule for a factor's keys: ``Q_<k>``, and ``Q_<k>_absmax`` beside quantised codes; and
#: ``Q_lower_bound`` (``variant="heavyball"``: :data:`.variant.LOWER_BOUND`), kept as the factors.
_FACTOR_KEY = re.compile(rf"Q_(?:(?P<index>\d+)(?P<absmax>{codecs.ABSMAX})?|lower_bound)")


def init_param_state(
    state: dict[str, Any], p: torch.Tensor, mu_dtype: torch.dtype | None, eight_bit: bool = False
) -> None:
    """A parameter's state at its first step with a gradient: step 0 and a zero momentum (an 8-bit
    one is made by :func:`dist_optim.states.bnb.start_8bit` at its first update)."""
    state["step"] = torch.zeros((), dtype=torch.float32)
    if not eight_bit:
        state[MOMENTUM] = torch.zeros_like(p, dtype=mu_dtype or p.dtype, memory_format=torch.preserve_format)


def factor_key(k: int) -> str:
    """The state key of factor ``k``."""
    return f"Q_{k}"


def is_factor_key(key: str) -> bool:
    return _FACTOR_KEY.fullmatch(key) is not None


def has_factors(state: dict[str, Any]) -> bool:
    """Whether the factors exist (made on the owner at its first step)."""
    return factor_key(0) in state


def absmax_key(k: int) -> str:
    """The state key of quantised factor ``k``'s block absmax (a factor key too: it travels, and
    stays on the owner, with the codes)."""
    return codecs.absmax_key(factor_key(k))


@dataclass(frozen=True)
class FactorForm:
    """How a param group stores its triangular factors: ``packed`` (``use_symmetric_packing``: the
    upper triangle), ``bits`` (``preconditioner_bits``: 32, or 8 for block-wise codes) and
    ``dtype``, the one the math uses (``precond_dtype``, default fp32)."""

    packed: bool
    bits: int = 32
    dtype: torch.dtype = torch.float32
    #: ``variant="heavyball"``: the running lower bounds are stored with the factors.
    lower_bound: bool = False

    @property
    def quantized(self) -> bool:
        return self.bits < 32

    @property
    def compact(self) -> bool:
        """Whether the stored form differs from the whole matrix (the math works in scratch)."""
        return self.packed or self.quantized

    @property
    def codec(self) -> codecs.Codec:
        """How a triangular factor is stored: codes (of its packed upper triangle with packing),
        a packed upper triangle, or whole."""
        if self.quantized:
            return codecs.LowBit(self.bits, codecs.PACKED_UPPER if self.packed else None)
        return codecs.PACKED_UPPER if self.packed else codecs.PLAIN


def factor_form(group: dict[str, Any]) -> FactorForm:
    """A param group's :class:`FactorForm`."""
    return FactorForm(
        bool(group["use_symmetric_packing"]), int(group["preconditioner_bits"]), precond_dtype(group), heavy(group)
    )


def factors(state: dict[str, Any], plan: FactorPlan) -> list[torch.Tensor]:
    """The stored factor tensors of ``plan`` in dim order (codes, where quantised)."""
    return [state[factor_key(k)] for k in range(len(plan.factor_shapes()))]


def store_factors(state: dict[str, Any], tensors: Sequence[torch.Tensor], plan: FactorPlan, form: FactorForm) -> None:
    """Store new whole factors in ``form`` (packed triangles; codes and absmax where quantised)."""
    for k, (t, d) in enumerate(zip(tensors, plan.diag or (True,))):
        codec = form.codec
        if d or not form.compact:
            state[factor_key(k)] = t
        elif isinstance(codec, codecs.LowBit):
            state[factor_key(k)], state[absmax_key(k)] = codec.quantize(t)
        else:
            state[factor_key(k)] = codecs.PACKED_UPPER.pack(t)


def stored_specs(plan: FactorPlan, form: FactorForm) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(key, shape, dtype)`` of every stored factor tensor of ``plan`` in ``form``: the factors of
    :meth:`FactorPlan.factor_shapes` in ``form.dtype``, a packed triangular one ``(n (n + 1) / 2,)``,
    a quantised one its 1-D uint8 codes (of the packed or whole ``n x n`` elements) and fp32 absmax."""
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for k, shape in enumerate(plan.factor_shapes()):
        codec = form.codec if len(shape) == 2 else codecs.PLAIN
        out += codec.stored(factor_key(k), tuple(shape), form.dtype)
    if form.lower_bound:
        out.append((LOWER_BOUND, (len(plan.factor_shapes()),), torch.float64))
    return out


class FactorScratch:
    """Reused memory for one parameter's unpacked triangular factors at a time: one buffer per
    factor index, dtype and device, grown to the largest factor unpacked into it. It stays
    allocated between steps (fresh factor-sized memory costs page faults on the CPU that are
    comparable to the unpacking itself): at most ``max_size_triangular^2`` elements per dim of the
    owned parameters with triangular factors."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, k: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous ``(n, n)`` tensor over factor index ``k``'s buffer (from its start)."""
        key = (k, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n * n:
            buf = self._buffers[key] = torch.empty(n * n, dtype=dtype, device=device)
        return buf[: n * n].view(n, n)


def whole_factors(
    state: dict[str, Any], plan: FactorPlan, form: FactorForm, scratch: FactorScratch | None
) -> list[torch.Tensor]:
    """The factors of ``plan`` as the math uses them: the stored tensors (updated in place), or in
    a compact ``form`` the triangular ones unpacked and/or dequantised into ``scratch`` (fresh
    memory without one), to be stored back by :func:`store_whole` where they change."""
    stored = factors(state, plan)
    if not form.compact:
        return stored
    codec = form.codec
    out = []
    for k, (q, d) in enumerate(zip(stored, plan.diag or (True,))):
        if d:
            out.append(q)
            continue
        n = plan.shape[k]
        buf = scratch.get(k, n, form.dtype, q.device) if scratch is not None else None
        if isinstance(codec, codecs.LowBit):
            # fp32 values (exact in fp32: a code's value times its absmax), then the math's dtype.
            q = codec.decode(state, factor_key(k), side=n, flat=True).to(form.dtype)
            if not form.packed:
                whole = buf if buf is not None else torch.empty(n, n, dtype=form.dtype, device=q.device)
                out.append(whole.copy_(q.view(n, n)))
                continue
        out.append(codecs.PACKED_UPPER.unpack(q, n, out=buf))
    return out


def store_whole(
    state: dict[str, Any],
    plan: FactorPlan,
    whole: Sequence[torch.Tensor],
    form: FactorForm,
    generator: torch.Generator | None = None,
) -> None:
    """Store the triangular factors ``whole`` (of :func:`whole_factors` in a compact ``form``) back
    in place: packed, or quantised anew (codes and absmax; the triangle's zeros stay the zero
    code), rounded stochastically with ``generator``'s uniforms, drawn factor after factor in dim
    order (to nearest without one); the diagonal ones are the stored tensors themselves."""
    codec = form.codec
    for k, (q, d) in enumerate(zip(whole, plan.diag or (True,))):
        if not d:
            codec.encode(q, state, factor_key(k), generator=generator)


def check_factor_shapes(state: dict[str, Any], plan: FactorPlan, form: FactorForm, full_shape: tuple[int, ...]) -> None:
    """For ``load_full_state``: the state's factors, where it has them, have this group's stored
    shapes and kinds (codes or floating point; a state saved with other factor options is refused,
    before anything is replaced)."""
    if not has_factors(state):
        return
    for key, shape, dtype in stored_specs(plan, form):
        value = state.get(key)
        got: Any = value
        if isinstance(value, torch.Tensor):
            got = (tuple(value.shape), "uint8 codes" if codecs.quantized(value) else "floating point")
        want = (tuple(shape), "uint8 codes" if dtype == torch.uint8 else "floating point")
        if got != want:
            raise ValueError(
                f"load_full_state: state {key!r} of a parameter of full shape {full_shape} should be "
                f"{want[1]} of shape {want[0]}, got {got!r}; was it saved with use_symmetric_packing="
                f"{not form.packed}, another preconditioner_bits than {form.bits} or other factor options "
                "(max_size_triangular, min_ndim_triangular, memory_save_mode, merge_dims)?"
            )


def without_factors(state: dict[str, Any]) -> dict[str, Any]:
    """A full-form state as a rank that does not own the parameter keeps it."""
    return {k: v for k, v in state.items() if not is_factor_key(k)}


def keeps_saved_dtype(key: str) -> bool:
    """The factors (``precond_dtype``), the momentum (``mu_dtype``, or 8-bit codes) and its 8-bit
    fp32 absmax keep their saved dtype on load; torch's loader would cast them to the parameter's."""
    return is_factor_key(key) or key.startswith(MOMENTUM)


def check_loaded_forms(
    saved: Any, groups: list[dict[str, Any]], diagonal: Callable[[torch.Tensor, dict[str, Any]], Sequence[bool]]
) -> None:
    """Refuse, before anything is loaded, a state dict whose factors are not in the form of its
    param groups: whole (2-D) factors where a group has ``use_symmetric_packing``, floating-point
    factors where it has ``preconditioner_bits=8`` or codes where it has 32. A state dict saved
    before an option existed has none in its groups and takes the loading optimizer's value (the
    base's loader), but its factors are in the old form. (Packed or quantised factors always come
    with their options saved, so the other directions arise only from edited state dicts.)
    ``diagonal(param, options)``: which of the parameter's factors are diagonal (kept in floating
    point whatever ``preconditioner_bits``) under a group's options."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return  # the base's loader names what is wrong
    for built, group in zip(groups, saved["param_groups"]):
        options = {**built, **group}
        packed, bits = options.get("use_symmetric_packing"), options.get("preconditioner_bits", 32)
        for param, pid in zip(built["params"], group.get("params", [])):
            for key, value in saved.get("state", {}).get(pid, {}).items():
                m = _FACTOR_KEY.fullmatch(key)
                if m is None or m.group("index") is None or m.group("absmax") or not isinstance(value, torch.Tensor):
                    continue
                if packed and value.dim() == 2:
                    raise ValueError(
                        f"load_state_dict: factor {key!r} is a whole matrix where the param group has "
                        "use_symmetric_packing=True; build the optimizer with use_symmetric_packing=False to load it"
                    )
                codes = codecs.quantized(value)
                if not codes and bits < 32 and _diagonal_factor(int(m.group("index")), param, options, diagonal):
                    continue
                if codes != (bits < 32):
                    form, fix = ("quantised codes", 8) if codes else (f"in {value.dtype}", 32)
                    raise ValueError(
                        f"load_state_dict: factor {key!r} is {form} where the param group has preconditioner_bits="
                        f"{bits}; build the optimizer with preconditioner_bits={fix} to load it"
                    )


_Diagonal = Callable[[torch.Tensor, dict[str, Any]], Sequence[bool]]


def _diagonal_factor(k: int, param: torch.Tensor, options: dict[str, Any], diagonal: _Diagonal) -> bool:
    """Whether factor ``k`` of ``param`` is diagonal under ``options`` (an index beyond the plan's
    factors: left to the loader's other checks)."""
    diag = diagonal(param, options)
    return k >= len(diag) or bool(diag[k])
