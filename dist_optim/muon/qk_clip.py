"""QK-clip (MuonClip; Kimi Team 2025, "Kimi K2: Open Agentic Intelligence", arXiv:2507.20534,
Sec. 2.1 and Algorithm 1): after each optimizer step, the query and key weights of every
attention head whose largest attention logit in the step exceeded ``tau`` are scaled down, so that
the same inputs would give a largest logit of ``tau``.

For head ``h`` of an attention layer, over the step's forward passes (every micro-batch, every
data-parallel rank's batch)::

    S_h   = max over sequences, query i, key j allowed by the mask of  q_i^h . k_j^h * scaling
    gamma = min(1, tau / S_h)
    W_q^h <- W_q^h * gamma^alpha,   W_k^h <- W_k^h * gamma^(1 - alpha)      (alpha = 0.5: the report's)

with ``q`` and ``k`` after the rotary embedding (a rotation, so scaling the weights scales the
logits by exactly ``gamma``). Deviation, grouped-query attention (Llama-2-70B, Mistral, Qwen2):
a key head is shared by several query heads, so scaling it would change heads that did not
exceed ``tau``; as the report does for MLA's shared rotary key, the key is left alone and each
query head takes the whole ``gamma``. A projection bias (Qwen2's) is scaled with its rows.

Measurement (:class:`AttentionLogits`): forward hooks on each attention module's ``q_proj`` and
``k_proj`` keep their outputs, and a hook on the module itself (after it ran, so the outputs are
those the attention used) applies the rotary embedding it was given and takes the per-head
maximum of ``q k^T * scaling`` under its mask, in row blocks (at most :data:`LOGIT_BLOCK`
logits at a time; the attention's own kernel, flash or not, never materializes them). It costs
one more ``QK^T`` per layer in float32 (``python bench/bench_step.py --dist muon muon-qk-clip``
prints the boosted step with it against Muon's). Only forwards in training mode count. Under tensor parallelism each
rank measures the heads it computes; the optimizer max-reduces the maxima over the
data-parallel ranks (one all-reduce a step) and scales the rows of each head where they are: a
head's rows never move (:func:`clip_heads`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .. import comm
from ..layout import ParamLayout

__all__ = [
    "AttentionLogits",
    "HeadMaxima",
    "LogitSource",
    "LOGIT_BLOCK",
    "check_qk_clip",
    "clip_factors",
    "clip_heads",
    "max_logits",
    "projection_of",
    "scale_head_rows_",
    "watch_attention_logits",
]

#: Logits computed at once when measuring (rows of query positions per block): bounds the
#: measurement's scratch memory at 128 MiB in float32 whatever the sequence length.
LOGIT_BLOCK = 1 << 25

#: A reader of an attention module's ``attention_mask`` argument: ``(mask, batch, q_len, k_len)``
#: to a boolean ``(batch or 1, 1, q_len, k_len)`` tensor of the logits the attention computes, or
#: None for a causal attention without padding.
MaskReader = Callable[[Any, int, int, int], "torch.Tensor | None"]

_PROJECTION = re.compile(r"^(?P<attn>.*)\.(?P<which>[qk])_proj\.(?:weight|bias)$")


@dataclass
class HeadMaxima:
    """The largest logit of each query head an attention module computed since the last take
    (``-inf`` for none), with what the clip needs: the rows of a head, and how many query heads
    share a key head (1 without grouped-query attention)."""

    values: torch.Tensor
    head_dim: int
    group: int


class LogitSource(Protocol):
    """What a QK-clipping optimizer reads the step's maxima from: :class:`AttentionLogits` on a
    model, or a stand-in that knows them otherwise (the planner's, a replay's)."""

    #: The ranks the measurement split each sequence's queries over (their maxima are max-reduced
    #: over it too), or None.
    sequence_group: Any

    def take(self) -> dict[str, HeadMaxima]:
        """The maxima since the last take, by attention module name; start over."""
        ...

    def reset(self) -> None:
        """Forget the maxima measured so far."""
        ...


def check_qk_clip(tau: float | None, alpha: float) -> None:
    """ValueError naming the option for a ``qk_clip_tau`` that is not None or > 0, or an
    ``qk_clip_alpha`` outside [0, 1]."""
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0):
        raise ValueError(f"qk_clip_tau must be None (off) or a positive logit bound (Kimi K2: 100), got {tau!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"qk_clip_alpha must be in [0, 1] (the query's share of the scaling), got {alpha!r}")


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` (batch, heads, seq, head_dim) as Llama's attention applies it
    (``x cos + rotate_half(x) sin``, ``cos``/``sin`` of shape (batch, seq, head_dim))."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def max_logits(
    q: torch.Tensor, k: torch.Tensor, scaling: float, allowed: torch.Tensor | None, offset: int | None = None
) -> torch.Tensor:
    """The largest ``q_i . k_j * scaling`` of each query head over the batch and the allowed
    (query, key) pairs: ``q`` (batch, heads, q_len, d), ``k`` (batch, kv_heads, k_len, d),
    ``allowed`` a boolean mask broadcastable to (batch, 1, q_len, k_len), or None for causal
    (key ``j`` allowed for query ``i`` when ``j <= i + offset``; ``offset`` the position of the
    first query, default ``k_len - q_len``: the queries are the last ones). ``-inf`` for a head
    without an allowed pair. Computed in row blocks of at most :data:`LOGIT_BLOCK` logits."""
    b, heads, q_len, d = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qg = q.reshape(b, kv_heads, group, q_len, d)
    kt = k.transpose(-1, -2).unsqueeze(2)  # (b, kv_heads, 1, d, k_len)
    best = torch.full((heads,), -math.inf, dtype=q.dtype, device=q.device)
    rows = max(1, LOGIT_BLOCK // max(1, b * heads * k_len))
    keys = torch.arange(k_len, device=q.device)
    offset = k_len - q_len if offset is None else offset
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        logits = torch.matmul(qg[:, :, :, start:stop], kt) * scaling  # (b, kv, group, rows, k_len)
        if allowed is None:
            queries = torch.arange(start, stop, device=q.device)
            keep = keys[None, :] <= queries[:, None] + offset
        else:
            keep = allowed[..., start:stop, :].unsqueeze(2)  # (b or 1, 1, 1, rows, k_len)
        logits = logits.masked_fill(~keep, -math.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 3, 4)).reshape(heads))
    return best


def hf_mask(mask: Any, batch: int, q_len: int, k_len: int) -> torch.Tensor | None:
    """:data:`MaskReader` of a Hugging Face attention's mask: None (causal), a boolean mask, or an
    additive float mask (0 where attended, the dtype's minimum where not), cut to ``k_len`` keys as
    transformers' attention cuts it."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(
            f"QK-clip: an attention mask of type {type(mask).__name__} is not one it can read (None, or a 4-D "
            "tensor as transformers' eager and sdpa attentions take); the dist_optim plugins read ColossalAI's"
        )
    mask = mask[..., :q_len, :k_len]
    return mask if mask.dtype == torch.bool else mask == 0


class AttentionLogits:
    """Per-head largest attention logits of every attention module of ``model`` (a module with
    ``q_proj`` and ``k_proj`` children and a ``head_dim``: Llama, Mistral, Qwen2, Mixtral and their
    ColossalAI-sharded forms), over the training-mode forwards since the last :meth:`take`.

    ``mask_reader`` turns an attention's ``attention_mask`` argument into the pairs it attends
    (default :func:`hf_mask`); ``rename`` maps ``model``'s module names to the names the optimizer
    knows its parameters by (a wrapper's prefixes removed). ``sequence_group``: the ranks over which
    the sequence is split before the q/k projections, in order (ColossalAI's ``all_to_all``
    sequence parallelism): each rank's keys are gathered from the group (one all-gather per layer
    and forward) and its queries, those of its own positions, met with all of them; the maxima are
    then max-reduced over the group with the data-parallel ranks'."""

    def __init__(
        self,
        model: torch.nn.Module,
        mask_reader: MaskReader = hf_mask,
        rename: Callable[[str], str] = lambda name: name,
        sequence_group: Any = None,
    ) -> None:
        self.mask_reader = mask_reader
        self.sequence_group = sequence_group
        self.modules: dict[str, torch.nn.Module] = {}
        self._maxima: dict[str, torch.Tensor] = {}
        self._heads: dict[str, tuple[int, int]] = {}  # (query heads, key heads) each module computes
        self._outputs: dict[int, dict[str, torch.Tensor]] = {}
        self._handles: list[Any] = []
        for name, module in model.named_modules():
            if not all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("q_proj", "k_proj")):
                continue
            if not isinstance(getattr(module, "head_dim", None), int):
                continue
            if getattr(module.q_proj, "weight", None) is None:
                continue  # another pipeline stage's layer: ColossalAI keeps the module, not its weights
            key = rename(name)
            self.modules[key] = module
            self._handles += [
                module.q_proj.register_forward_hook(self._keep(module, "q")),
                module.k_proj.register_forward_hook(self._keep(module, "k")),
                module.register_forward_hook(self._measure(key), with_kwargs=True),
            ]
        if not self.modules:
            raise ValueError(
                f"QK-clip found no attention module in {type(model).__name__} (one with q_proj and k_proj children "
                "and a head_dim, as Llama, Mistral, Qwen2 and Mixtral have): leave qk_clip_tau=None for this model"
            )

    def _keep(self, attention: torch.nn.Module, which: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
            if attention.training:
                # As a plain tensor: a framework's subclass (Gemini's ColoTensor) would carry its own
                # dispatch into the maxima, and the clip's in-place products by them would miss.
                self._outputs.setdefault(id(attention), {})[which] = output.detach().as_subclass(torch.Tensor)

        return hook

    def _measure(self, key: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            outputs = self._outputs.pop(id(module), None)
            if not module.training or outputs is None or set(outputs) != {"q", "k"}:
                return
            with torch.no_grad():
                found = self._head_maxima(module, args, kwargs, outputs["q"], outputs["k"])
            self._heads[key] = (found.numel(), outputs["k"].shape[-1] // int(module.head_dim))
            held = self._maxima.get(key)
            self._maxima[key] = found if held is None else torch.maximum(held, found)

        return hook

    def _head_maxima(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], q: torch.Tensor, k: torch.Tensor
    ) -> torch.Tensor:
        embeddings = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        if embeddings is None:
            raise ValueError(
                f"QK-clip: {type(module).__name__} was called without position_embeddings (cos, sin); it reads the "
                "rotary embedding the attention applies, as transformers >= 4.48 passes it"
            )
        cos, sin = embeddings
        d = int(module.head_dim)
        b, q_len = q.shape[0], q.shape[1]
        offset = 0
        if self.sequence_group is not None:
            k = comm.all_gather_along(k.contiguous(), 1, self.sequence_group)
            offset = comm.group_rank(self.sequence_group) * q_len
        k_len = k.shape[1]
        if cos.shape[-2] != k_len:
            raise ValueError(
                f"QK-clip: {type(module).__name__}'s k_proj gave {k_len} positions but its rotary embedding has "
                f"{cos.shape[-2]}: the sequence is split before attention in a way it does not follow (ColossalAI's "
                "'ring_attn'); use sequence_parallelism_mode='split_gather' or 'all_to_all' with qk_clip_tau"
            )
        work = q.dtype if q.dtype == torch.float64 else torch.float32
        cos, sin = cos.to(work), sin.to(work)
        qh = q.to(work).view(b, q_len, -1, d).transpose(1, 2)
        kh = k.to(work).view(b, k_len, -1, d).transpose(1, 2)
        here = slice(offset, offset + q_len)
        qh, kh = rotate(qh, cos[:, here], sin[:, here]), rotate(kh, cos, sin)
        scaling = float(getattr(module, "scaling", d**-0.5))
        allowed = self.mask_reader(mask, b, k_len, k_len)
        return max_logits(qh, kh, scaling, None if allowed is None else allowed[..., here, :], offset)

    def take(self) -> dict[str, HeadMaxima]:
        """The maxima since the last take, by attention module name, and start over. Local to this
        process. A module that ran no training forward since gets ``-inf`` for every head (every
        data-parallel rank must list the same modules: their maxima are reduced together); one
        that never ran is left out."""
        out = {}
        for key, module in self.modules.items():
            if key not in self._heads:
                continue
            heads, kv_heads = self._heads[key]
            values = self._maxima.pop(key, None)
            if values is None:
                weight = module.q_proj.weight
                dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
                values = torch.full((heads,), -math.inf, dtype=dtype, device=weight.device)
            out[key] = HeadMaxima(values, int(module.head_dim), max(1, heads // max(1, kv_heads)))
        self._outputs.clear()
        return out

    def reset(self) -> None:
        """Forget the maxima measured so far (a skipped step's)."""
        self._maxima.clear()
        self._outputs.clear()

    def remove(self) -> None:
        """Remove the hooks from the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def clip_factors(maxima: HeadMaxima, tau: float, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors of each query head's rows and each key head's rows: ``gamma^alpha`` and
    ``gamma^(1 - alpha)`` per head, or with grouped-query attention ``gamma`` for the query heads
    and 1 for the shared key heads (module docstring)."""
    gamma = torch.where(maxima.values > tau, tau / maxima.values, torch.ones_like(maxima.values))
    if maxima.group == 1:
        return gamma.pow(alpha), gamma.pow(1.0 - alpha)
    return gamma, torch.ones(gamma.numel() // maxima.group, dtype=gamma.dtype, device=gamma.device)


def scale_head_rows_(param: torch.Tensor, layout: ParamLayout, factors: torch.Tensor, head_dim: int) -> None:
    """Multiply, in place, the elements of ``param`` (this rank's piece of a projection: its TP
    slice's ZeRO chunk or flat range, or the whole tensor) by the factor of the head of their row
    (``factors`` for the heads of the TP slice, ``head_dim`` rows each). Heads with factor 1 are
    not touched; each other head's rows are one contiguous range of the slice's flattened tensor,
    cut to the piece: no index tensor is made."""
    rows_local = layout.local_shape[0]
    per_row = layout.local_numel // max(1, rows_local)
    start, stop = layout.chunk_range
    flat = param.view(-1)
    for head in torch.nonzero(factors != 1).flatten().tolist():
        lo = max(start, head * head_dim * per_row)
        hi = min(stop, (head + 1) * head_dim * per_row, layout.local_numel)
        if lo < hi:
            flat[lo - start : hi - start].mul_(factors[head].to(param.dtype))


def clip_heads(
    optimizer: Any, taken: dict[str, HeadMaxima], tau: float, alpha: float, sequence_group: Any = None
) -> None:
    """QK-clip of a :class:`~dist_optim.base.DistOptimizer` after its update: the maxima
    ``taken`` from the step's forwards max-reduced over its data-parallel ranks and then over
    ``sequence_group`` where the measurement split the queries over one (one all-reduce a group,
    in place; none unbound), then every ``q_proj``/``k_proj`` piece it holds, found by the
    parameter's model name, scaled in place by its heads' factors."""
    if optimizer.is_bound:
        groups = tuple(g for g in (optimizer.dp_group, sequence_group) if g is not None)
        maxima = comm.MaxBucket()
        for name in sorted(taken):
            maxima.add(taken[name].values, groups)
        maxima.flush()
    factors = {name: clip_factors(m, tau, alpha) for name, m in taken.items()}
    for p, name in optimizer.named_params():
        found = projection_of(name or "")
        if found is None or found[0] not in factors:
            continue
        attention, which = found
        rows = factors[attention][0 if which == "q" else 1]
        scale_head_rows_(p, optimizer.layout(p), rows, taken[attention].head_dim)


def projection_of(name: str) -> tuple[str, str] | None:
    """``(attention module name, "q" or "k")`` of a ``q_proj``/``k_proj`` weight or bias name."""
    match = _PROJECTION.match(name)
    return None if match is None else (match["attn"], match["which"])


def watch_attention_logits(
    model: torch.nn.Module,
    optimizer: Any,
    mask_reader: MaskReader = hf_mask,
    rename: Callable[[str], str] = lambda name: name,
    sequence_group: Any = None,
) -> AttentionLogits:
    """Measure ``model``'s attention logits for ``optimizer`` (a :class:`DistributedMuon` built with
    ``qk_clip_tau``), which clips after each step. The dist_optim booster plugins call this at
    ``booster.boost``; call it yourself when you step the optimizer without a booster. The
    optimizer's parameters that are ``model``'s own are named from it. ``sequence_group``: see
    :class:`AttentionLogits`."""
    monitor = AttentionLogits(model, mask_reader, rename, sequence_group)
    ours = {p for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        if p in ours:
            optimizer.param_names.setdefault(p, rename(name))
    optimizer.attention_logits = monitor
    return monitor
