"""Booster parity: a tiny Llama trained through a real ColossalAI booster with an ordinary
optimizer (swapped for ours by dist_optim.plugins) against the same model trained on one process
with our unbound optimizer. Runs inside DistPool workers."""

from __future__ import annotations

import copy
import importlib
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

from dist_optim.plugins.cpu import install, quiet_colossal
from dist_optim.plugins.fsdp import clean_name
from dist_optim.testing import VOCAB, tiny_llama, tiny_mixtral
from tests.helpers.check import describe, excess, max_rel_err

#: Element-wise tolerance of the replayed single-device run: the parity grid's (tests/helpers/parity.py).
REPLAY_RTOL = 1e-5
#: Gemini's chunk search for the tiny Llama: no minimum chunk size (the default, 32 Mi elements, keeps
#: a model this small whole on every rank) and chunks of the largest parameter's size (the embedding),
#: so that parameters are cut anywhere by the 4 ranks' shards of several chunks.
GEMINI_CHUNKS = dict(min_chunk_size_m=0.0, search_range_m=0, hidden_dim=64)
GLOBAL_BATCH = 4  # sequences per step, split over data-parallel ranks (dp in 1, 2, 4)
SEQ = 16


def model_kind(plugin_name: str) -> str:
    """The tiny model a plugin's tests train: a Mixtral under MoE, a Llama otherwise."""
    return "mixtral" if plugin_name.startswith("Moe") else "llama"


def model_for(plugin_name: str) -> torch.nn.Module:
    return tiny_mixtral() if model_kind(plugin_name) == "mixtral" else tiny_llama()


def make_optimizer(path: str, model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """``path(model.parameters(), **kwargs)``; a ``galore`` entry in kwargs instead builds GaLore
    param groups (attention and MLP weights, the format galore_torch and ours share), a ``muon``
    entry Muon's split (``dist_optim.muon_param_groups(model, **entry)``: hidden matrices to Muon,
    embeddings, head, norms and biases to its AdamW)."""
    module, name = path.rsplit(".", 1)
    kwargs = dict(kwargs)
    galore = kwargs.pop("galore", None)
    if galore is not None:
        from dist_optim import galore_param_groups

        return getattr(importlib.import_module(module), name)(galore_param_groups(model, **galore), **kwargs)
    muon = kwargs.pop("muon", None)
    if muon is not None:
        from dist_optim import muon_param_groups

        return getattr(importlib.import_module(module), name)(muon_param_groups(model, **muon), **kwargs)
    return getattr(importlib.import_module(module), name)(model.parameters(), **kwargs)


def balance_router(model: Any, tokens: int, experts: int = 4) -> None:
    """Make a boosted Mixtral route as the planner does (every expert ``tokens x top_2 / experts``
    tokens): each layer's router logits get 100 added at experts ``i mod 4`` and ``i + 1 mod 4`` of
    token ``i``, which then are its top 2 (the tiny routers' own logits are below 1); the gradient
    still flows through the logits. The offsets are made once, in the working precision, before
    anything is measured."""
    layers = model.unwrap().model.layers
    rows = torch.arange(tokens)
    offsets = torch.zeros(tokens, experts, dtype=layers[0].block_sparse_moe.gate.weight.dtype)
    offsets[rows, rows % experts] = offsets[rows, (rows + 1) % experts] = 100.0

    def route(module: Any, inputs: Any, logits: torch.Tensor) -> torch.Tensor:
        return logits + offsets

    for layer in layers:
        layer.block_sparse_moe.gate.register_forward_hook(route)


def global_batch(step: int) -> torch.Tensor:
    """The same batch at a step whatever the layout, so runs at different dp sizes compare."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)


def rank_batch(step: int, dp_size: int, dp_rank: int) -> torch.Tensor:
    per = GLOBAL_BATCH // dp_size
    return global_batch(step)[dp_rank * per : (dp_rank + 1) * per]


def dp_coords(plugin: Any) -> tuple[int, int]:
    # Gemini calls its data-parallel group (tensor parallelism aside) its ZeRO group.
    group = getattr(plugin, "dp_group", None) or getattr(plugin, "zero_group", None)
    return dist.get_world_size(group), dist.get_rank(group)


def train_boosted(booster: Any, model: Any, wrapper: Any, plugin: Any, steps: range) -> None:
    dp_size, dp_rank = dp_coords(plugin)
    pipeline = getattr(plugin, "pp_size", 1) > 1
    for step in steps:
        x = rank_batch(step, dp_size, dp_rank)
        if pipeline:
            # ColossalAI divides each microbatch's loss by their number: the rank's mean loss.
            booster.execute_pipeline(
                iter([{"input_ids": x, "labels": x}]), model, lambda out, batch: out.loss, wrapper, return_loss=True
            )
        else:
            extra = {}
            if getattr(plugin, "enable_sequence_parallelism", False):
                # Without a mask transformers 4.51 builds a causal mask one key longer than the
                # sequence (its own attention slices it), which ColossalAI's SP attention rejects.
                extra["attention_mask"] = torch.ones_like(x)
            loss = model(input_ids=x, labels=x, **extra).loss
            booster.backward(loss, wrapper)
        wrapper.step()
        wrapper.zero_grad()


def named_masters(model: Any, wrapper: Any) -> tuple[list[torch.Tensor], list[str]]:
    """The boosted optimizer's masters in param-group order, and each one's model name (through
    the wrapper's master-to-working map where ColossalAI keeps separate masters)."""
    masters = [p for g in wrapper.optim.param_groups for p in g["params"]]
    to_working = wrapper.get_master_to_working_map() if hasattr(wrapper, "get_master_to_working_map") else None
    names = {id(p): clean_name(n) for n, p in model.unwrap().named_parameters()}
    return masters, [names[id(to_working[id(m)] if to_working else m)] for m in masters]


def master_weights(model: Any, wrapper: Any) -> dict[str, torch.Tensor]:
    """Full fp32 weights by parameter name, gathered from the optimizer's masters and layouts."""
    from dist_optim import comm

    opt = wrapper.optim
    masters, names = named_masters(model, wrapper)
    fulls = comm.gather_full([(opt.layout(p), p) for p in masters])
    return {name: full.float() for name, full in zip(names, fulls)}


#: ColossalAI's initial fp16 loss scale in these tests (tests/distributed/test_booster.py plugin_config).
FP16_INITIAL_SCALE = 2.0**16


def reference_run(
    opt_path: str,
    opt_kwargs: dict[str, Any],
    steps: int,
    low_precision: torch.dtype | None = None,
    pipeline: bool = False,
    plugin_name: str = "HybridParallelPlugin",
    grad_noise: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """The single-process run, in the booster's precision: with ``low_precision`` the model computes
    in that dtype from working weights that are the rounded fp32 masters the optimizer updates
    (fp16 with a dynamic loss scale: a step whose gradients overflow is skipped and the scale
    halved), as ColossalAI's mixed precision does. ``pipeline``: with the randomness the plugins
    choose under pipeline parallelism (layout-independent), parameters known by their model names as
    the plugins do. ``grad_noise``: after every backward, multiply each entry of a named gradient by
    ``1 + d u`` with ``d`` its relative amplitude and ``u`` uniform in ``[-1, 1]`` (a fixed seed):
    the noise-floor run of :func:`booster_parity`. Returns the fp32 weights by name."""
    import dist_optim

    model = model_for(plugin_name)
    working = model
    if low_precision is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(low_precision).float())
        working = copy.deepcopy(model).to(low_precision)
    pairs = list(zip(model.named_parameters(), working.parameters()))
    opt = dist_optim.convert(make_optimizer(opt_path, model, opt_kwargs))
    opt.param_names = {p: n for n, p in model.named_parameters()}
    if getattr(opt, "qk_clip_tau", None) is not None:
        dist_optim.watch_attention_logits(working, opt)  # the model that runs the forwards
    if pipeline:
        opt.use_layout_independent_randomness()
    scale = FP16_INITIAL_SCALE if low_precision == torch.float16 else 1.0
    gen = torch.Generator().manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "stepping unbound in a multi-process job": on purpose
        for step in range(steps):
            x = global_batch(step)
            (working(input_ids=x, labels=x).loss * scale).backward()
            for (n, p), w in pairs:
                if w is not p:
                    p.grad = None if w.grad is None else w.grad.float() / scale
                    w.grad = None
                if grad_noise and n in grad_noise and p.grad is not None:
                    p.grad.mul_(1 + (2 * torch.rand(p.shape, generator=gen) - 1) * grad_noise[n])
            if scale != 1.0 and not all(bool(p.grad.isfinite().all()) for (_, p), _ in pairs if p.grad is not None):
                scale /= 2
                continue
            opt.step()
            opt.zero_grad()
            if working is not model:
                with torch.no_grad():
                    for (_, p), w in pairs:
                        w.copy_(p)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def gradient_noise(record: dict[str, Any], plugin_name: str, low_precision: torch.dtype | None) -> dict[str, float]:
    """How far the boosted model's gradients are from one process's at the same weights and in the
    same precision (the first record: the same weights, the same global batch), element by element:
    for each parameter this rank holds, the median over its non-zero gradient entries of
    ``|g_boosted - g_single| / |g_single|`` (the typical relative rounding difference; a median,
    because entries near zero have arbitrary relative differences)."""
    model = model_for(plugin_name)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in record["values"]:
                p.copy_(record["values"][n])
    if low_precision is not None:
        model.to(low_precision)
    scale = FP16_INITIAL_SCALE if low_precision == torch.float16 else 1.0
    x = global_batch(0)
    (model(input_ids=x, labels=x).loss * scale).backward()
    out = {}
    for n, p in model.named_parameters():
        if n in record["grads"]:
            single = p.grad.float() / scale
            nonzero = single != 0
            rel = (record["grads"][n] - single).abs()[nonzero] / single.abs()[nonzero]
            out[n] = rel.median().item() if rel.numel() else 0.0
    return out


#: This worker's single-process runs by their inputs: one is the same for every column of a row
#: with the same precision, model and randomness (e.g. 6 of the 13 columns are bf16 Llama runs).
_EXPECTED: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}


def shared_reference_runs(
    opt_path: str, opt_kwargs: dict[str, Any], steps: int, run: dict[str, Any], noise: dict[str, float]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """:func:`reference_run` plain and with ``grad_noise``, each computed on one rank and sent to
    all (a single process's result is the same on every rank; computed on each, 4 ranks on 2 cores
    ran it 4 times). The noise is every rank's :func:`gradient_noise` merged, the largest per
    parameter: under pipeline parallelism each rank measures its own stage's parameters only, and
    the noisy run perturbs them all, as the boosted run's gradients are. Rank 1 (rank 0 in a
    one-process world) keeps its plain runs: a later column with the same inputs reuses one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, noise)
    merged: dict[str, float] = {}
    for theirs in every:
        for name, d in theirs.items():
            merged[name] = max(d, merged.get(name, 0.0))
    plain_rank = min(1, world - 1)
    key = (opt_path, repr(opt_kwargs), steps, run["low_precision"], run["pipeline"], model_kind(run["plugin_name"]))
    noisy = [reference_run(opt_path, opt_kwargs, steps, **run, grad_noise=merged) if rank == 0 else None]
    if rank == plain_rank and key not in _EXPECTED:
        _EXPECTED[key] = reference_run(opt_path, opt_kwargs, steps, **run)
    expected = [_EXPECTED[key] if rank == plain_rank else None]
    dist.broadcast_object_list(noisy, src=0)
    dist.broadcast_object_list(expected, src=plain_rank)
    return expected[0], noisy[0]


def record_steps(wrapper: Any, model: Any) -> list[dict[str, Any]]:
    """Make the swapped optimizer record, at every step it takes, the full form of what ColossalAI
    hands it: each master's gradient and value before the update, by parameter name. Returns the
    list the records are appended to."""
    from dist_optim import comm

    opt = wrapper.optim
    masters, mnames = named_masters(model, wrapper)
    records: list[dict[str, Any]] = []
    real_step = opt.step

    def step(*args: Any, **kwargs: Any) -> Any:
        with_grad = [i for i, m in enumerate(masters) if m.grad is not None]
        grads = comm.gather_full([(opt.layout(masters[i]), masters[i].grad) for i in with_grad])
        values = comm.gather_full([(opt.layout(m), m.detach()) for m in masters])
        records.append(
            {
                "grads": {mnames[i]: g.float().clone() for i, g in zip(with_grad, grads)},
                "values": {n: v.float().clone() for n, v in zip(mnames, values)},
            }
        )
        result = real_step(*args, **kwargs)
        if getattr(opt, "qk_clip_tau", None) is not None:
            records[-1]["logits"] = full_max_logits(opt)
        return result

    opt.step = step
    return records


def full_max_logits(opt: Any) -> dict[str, Any]:
    """The per-head maxima QK-clip acted on in the last step, every head of each attention module
    (each TP rank measured its own heads: its rows of q_proj, in rank order), as
    :class:`~dist_optim.muon.qk_clip.HeadMaxima` for a replay."""
    from dist_optim.muon.qk_clip import HeadMaxima

    local = {name: m.values.detach().cpu() for name, m in opt.last_max_logits.items()}
    tp = opt.tp_group
    parts = [local]
    if tp is not None and dist.get_world_size(tp) > 1:
        parts = [None] * dist.get_world_size(tp)
        dist.all_gather_object(parts, local, group=tp)
    return {
        name: HeadMaxima(torch.cat([part[name] for part in parts]), m.head_dim, m.group)
        for name, m in opt.last_max_logits.items()
    }


class RecordedLogits:
    """What a boosted step's QK-clip measured, handed to the replayed optimizer in its place."""

    def __init__(self, maxima: dict[str, Any]) -> None:
        self.maxima = maxima
        self.sequence_group = None  # the replay is one process

    def take(self) -> dict[str, Any]:
        return self.maxima

    def reset(self) -> None:
        pass


def _boosted_run(
    plugin_name: str,
    plugin_kwargs: dict[str, Any],
    opt_path: str,
    opt_kwargs: dict[str, Any],
    steps: int,
    save_to: str | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, dict[str, Any]], Any, Any, list[dict[str, Any]]]:
    """(initial weights, full fp32 weights and full optimizer state of this rank's parameters after
    training, wrapper, plugin, what the optimizer was handed at each step). With ``save_to`` the
    optimizer is then saved there by ``booster.save_optimizer``, as one file and sharded."""
    from colossalai.booster import Booster

    from dist_optim import plugins

    with quiet_colossal():
        model = model_for(plugin_name)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = make_optimizer(opt_path, model, opt_kwargs)
        plugin = getattr(plugins, plugin_name)(**plugin_kwargs)
        booster = Booster(plugin=plugin)
        model, wrapper, *_ = booster.boost(model, optimizer)
        records = record_steps(wrapper, model)
        train_boosted(booster, model, wrapper, plugin, range(steps))
        if save_to is not None:
            booster.save_optimizer(wrapper, os.path.join(save_to, "optim.pt"), shard=False)
            booster.save_optimizer(wrapper, os.path.join(save_to, "optim"), shard=True)
        return init, master_weights(model, wrapper), boosted_states(model, wrapper), wrapper, plugin, records


def replay(
    opt_path: str,
    opt_kwargs: dict[str, Any],
    records: list[dict[str, Any]],
    pipeline: bool = False,
    plugin_name: str = "HybridParallelPlugin",
    start: dict[str, Any] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The single-device algorithm on exactly what the boosted optimizer was handed: the same
    optimizer, unbound, on full fp32 tensors starting from the boosted masters' first values, fed
    the recorded full gradients step by step (parameters another rank holds get ``None``). With
    ``start`` (``{"state": full state by name, "extra": extra_state()}``, e.g. right after loading
    a checkpoint) the optimizer starts from that state instead of a fresh one.
    Returns the weights and the optimizer state by parameter name."""
    import dist_optim

    model = model_for(plugin_name)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in records[0]["values"]:
                p.copy_(records[0]["values"][n])
    opt = dist_optim.convert(make_optimizer(opt_path, model, opt_kwargs))
    opt.param_names = {p: n for n, p in model.named_parameters()}
    if pipeline:
        opt.use_layout_independent_randomness()
    named = list(model.named_parameters())
    if start is not None:
        opt.load_full_state([start["state"][opt.param_names[p]] for g in opt.param_groups for p in g["params"]])
        opt.load_extra_state(start["extra"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "stepping unbound in a multi-process job": on purpose
        for record in records:
            for n, p in named:
                p.grad = record["grads"].get(n)
            if "logits" in record:
                opt.attention_logits = RecordedLogits(record["logits"])
            opt.step()
    order = [p for g in opt.param_groups for p in g["params"]]
    states = dict(zip((opt.param_names[p] for p in order), opt.full_state()))
    return {n: p.detach().clone() for n, p in named}, states


def boosted_states(model: Any, wrapper: Any) -> dict[str, dict[str, Any]]:
    """The boosted optimizer's full-form state (collective), by parameter name."""
    _, names = named_masters(model, wrapper)
    return dict(zip(names, wrapper.optim.full_state()))


def replay_mismatches(
    got: dict[str, torch.Tensor],
    got_states: dict[str, dict[str, Any]],
    ref: dict[str, torch.Tensor],
    ref_states: dict[str, dict[str, Any]],
    rtol: float,
) -> list[str]:
    """Element-wise comparison (tests/helpers/check.py) of this rank's weights and optimizer state with the
    replayed single-device run's."""
    out = []
    for name, value in got.items():
        if excess(value, ref[name], rtol) > 1:
            out.append(f"{name}: {excess(value, ref[name], rtol):.3g}x tolerance; {describe(value, ref[name])}")
        mine, theirs = got_states.get(name, {}), ref_states[name]
        if set(mine) != set(theirs):
            out.append(f"{name} state keys {sorted(mine)} != {sorted(theirs)}")
            continue
        for key, expected in theirs.items():
            actual = mine[key]
            if isinstance(expected, torch.Tensor):
                if not isinstance(actual, torch.Tensor) or excess(actual, expected, rtol) > 1:
                    out.append(f"{name}.{key}: {excess(actual, expected, rtol):.3g}x tolerance")
            elif actual != expected:
                out.append(f"{name}.{key}: {actual!r} != {expected!r}")
    return out


def _experts_on_moe_group(opt: Any, plugin: Any) -> bool | None:
    """Whether every expert parameter's ZeRO group is the MoE data-parallel group (the ranks that
    hold the same experts) and every other parameter's is not; None without MoE."""
    moe_group = getattr(plugin, "moe_dp_group", None)
    if moe_group is None:
        return None
    moe_ranks = dist.get_process_group_ranks(moe_group)
    ok = True
    # param_names (recorded by the plugin) maps each fp32 master to its model name
    for master, name in opt.param_names.items():
        ranks = dist.get_process_group_ranks(opt.layout(master).zero.group)
        ok &= (ranks == moe_ranks) == (".experts." in name)
    return ok and bool(opt.param_names)


def booster_parity(
    plugin_name: str,
    plugin_kwargs: dict[str, Any],
    opt_path: str,
    opt_kwargs: dict[str, Any],
    steps: int = 5,
    ckpt_dir: str | None = None,
) -> dict[str, Any]:
    """Train through the booster, then measure on this rank:

    * ``replay``: element-wise mismatches (tests/helpers/check.py, rtol ``REPLAY_RTOL``) of the weights and
      the full optimizer state against the single-device algorithm fed exactly what the boosted
      optimizer was handed (:func:`replay`). This is the optimizer's parity on the real layouts.
    * ``errors``: per parameter, how far the whole boosted run ended from one process training the
      same model in the same precision (:func:`reference_run`; ``update_rel``: relative to the size
      of the 5-step update; ``rel``: to the weight's scale). This also contains ColossalAI's own
      numerics (TP matmuls, gradient averaging and its order in low precision), which second-order
      optimizers amplify; ``floor_rel``: this parameter's own ``update_rel`` between the
      single-process run and its perturbed twin below; ``moved``: the size of the boosted run's
      update relative to the single-process run's (0 for a parameter that never moved).
    * ``grad_noise``: the largest per-parameter median relative difference between the gradients
      the boosted optimizer was first handed and one process's (:func:`gradient_noise`): rounding
      only, unless the gradients reached it scaled (a loss scale not divided out).
    * ``floor``: the largest ``update_rel`` between the single-process run and that run with its
      gradients perturbed by the boosted model's measured gradient noise (:func:`gradient_noise`):
      the scale at which ``errors`` is judged.
    * the binding facts (swap, TP/ZeRO layouts bound, groups).
    * ``unsafe_files``: with ``ckpt_dir``, the files of ``booster.save_optimizer`` (one file and
      sharded) that ``torch.load(..., weights_only=True)`` refuses, with its reason; ``saved_files``
      how many it read.
    """
    install()
    import dist_optim
    from dist_optim.comm import rules

    rules.reset_staged()
    init, got, got_states, wrapper, plugin, records = _boosted_run(
        plugin_name, plugin_kwargs, opt_path, opt_kwargs, steps, ckpt_dir
    )
    staged = sum(rules.STAGED.values())
    saved = weights_only_refusals(ckpt_dir) if ckpt_dir is not None else ({}, 0)
    pipeline = plugin_kwargs.get("pp_size", 1) > 1
    ref, ref_states = replay(opt_path, opt_kwargs, records, pipeline, plugin_name)
    replay_bad = replay_mismatches(got, got_states, ref, ref_states, REPLAY_RTOL)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plugin_kwargs.get("precision", "fp32"))
    if plugin_name == "LowLevelZeroPlugin" and "precision" not in plugin_kwargs:
        low = torch.float16
    run = dict(low_precision=low, pipeline=pipeline, plugin_name=plugin_name)
    noise = gradient_noise(records[0], plugin_name, low)
    grad_noise = max(noise.values(), default=0.0)
    expected, noisy = shared_reference_runs(opt_path, opt_kwargs, steps, run, noise)
    opt = wrapper.optim
    errors = {}
    floor = 0.0
    # Under pipeline parallelism a rank holds its stage's parameters only.
    for name in got:
        start = init[name] if low is None else init[name].to(low).float()
        delta = max((expected[name] - start).norm().item(), 1e-12)
        noise = (noisy[name] - expected[name]).norm().item() / delta
        errors[name] = {
            "rel": max_rel_err(got[name], expected[name]),
            "update_rel": (got[name] - expected[name]).norm().item() / delta,
            "floor_rel": noise,
            "moved": (got[name] - start).norm().item() / delta,
        }
        floor = max(floor, noise)
    masters = [p for g in opt.param_groups for p in g["params"]]
    return {
        "logits_rel": first_logits_error(records, plugin_name, low),
        "swapped_to": [c.__name__ for c in type(opt).__mro__],
        "is_dist_optim": isinstance(opt, dist_optim.DistOptimizer),
        "tp_bound": sum(opt.layout(p).tp is not None for p in masters),
        "zero_bound": sum(opt.layout(p).zero is not None for p in masters),
        "zero_sizes": sorted({opt.layout(p).zero.size for p in masters if opt.layout(p).zero is not None}),
        "experts_on_moe_group": _experts_on_moe_group(opt, plugin),
        "replay": replay_bad,
        "replayed_steps": len(records),
        "cpu_offload": bool(getattr(wrapper, "_cpu_offload", False)),
        "staged_bytes": staged,
        "errors": errors,
        "floor": floor,
        "grad_noise": grad_noise,
        "all_names": sorted(expected),
        "unsafe_files": saved[0],
        "saved_files": saved[1],
    }


def first_logits_error(records: list[dict[str, Any]], plugin_name: str, low: torch.dtype | None) -> float | None:
    """QK-clip: the largest relative difference between the per-head maxima the boosted run acted on
    at its first step and those one process measures on the same weights and global batch (None
    without QK-clip). The replay feeds the boosted run's own maxima; this checks the measurement."""
    import dist_optim

    if "logits" not in records[0]:
        return None
    model = model_for(plugin_name)
    if low is not None:
        model.to(low)
    opt = dist_optim.DistributedMuon(dist_optim.muon_param_groups(model), qk_clip_tau=1.0)
    monitor = dist_optim.watch_attention_logits(model, opt)
    x = global_batch(0)
    with torch.no_grad():
        model(input_ids=x, labels=x)
    single = monitor.take()
    worst = 0.0
    for name, got in records[0]["logits"].items():
        want = single[name].values.float()
        worst = max(worst, float(((got.values.float() - want).abs() / want.abs()).max()))
    return worst


def weights_only_refusals(folder: str) -> tuple[dict[str, str], int]:
    """Every torch file under ``folder`` loaded with ``weights_only=True``: the refused ones with
    the reason, and how many were read (the JSON index is not a torch file)."""
    refused: dict[str, str] = {}
    count = 0
    for root, _, files in os.walk(folder):
        for name in files:
            if name.endswith(".json"):
                continue
            count += 1
            try:
                torch.load(os.path.join(root, name), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - every refusal is reported with its reason
                refused[os.path.relpath(os.path.join(root, name), folder)] = f"{type(exc).__name__}: {exc}"[:300]
    return refused, count


def booster_parity_with_cpu_attention(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """:func:`booster_parity` with ColossalAI's ``ColoAttention.attention`` given torch's SDPA for
    its causal mask: its flash kernels have no CPU build, and what is tested is everything around
    the kernel (the mask dict, the q/k the attention is handed)."""
    from colossalai.shardformer.layer.attn import AttnMaskType, ColoAttention

    def attention(q: Any, k: Any, v: Any, attention_mask_type: Any = None, scale: Any = None, **rest: Any) -> Any:
        if attention_mask_type != AttnMaskType.CAUSAL:
            raise NotImplementedError(f"the test's CPU attention takes causal masks only, not {attention_mask_type}")
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)

    kernel = ColoAttention.__dict__["attention"]
    ColoAttention.attention = staticmethod(attention)  # type: ignore[method-assign]
    try:
        return booster_parity(*args, **kwargs)
    finally:  # the pool's workers run later tests
        ColoAttention.attention = kernel  # type: ignore[method-assign]


def heavyball_muon(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """heavyball's Muon over a model's matrices, as a user builds it (heavyball steps vectors by
    momentum alone, which dist_optim refuses): an ``opt_path`` for :func:`make_optimizer`."""
    import heavyball

    return heavyball.Muon([p for p in params if p.dim() >= 2], **kwargs)


def heavyball_soap(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """heavyball's SOAP over every parameter, as a user builds it: an ``opt_path`` for
    :func:`make_optimizer`."""
    import heavyball

    return heavyball.SOAP(list(params), **kwargs)


def heavyball_psgd_kron(params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """heavyball's PSGDKron over every parameter, as a user builds it: an ``opt_path`` for
    :func:`make_optimizer`."""
    import heavyball

    return heavyball.PSGDKron(list(params), **kwargs)
