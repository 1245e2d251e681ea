"""Booster parity: a tiny Llama trained through a real ColossalAI booster with an ordinary
optimizer (swapped for ours by dist_optim.plugins) against the same model trained on one process
with our unbound optimizer. Runs inside DistPool workers."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch
import torch.distributed as dist

from tests._colossal_cpu import install, quiet_colossal

GLOBAL_BATCH = 4  # sequences per step, split over data-parallel ranks (dp in 1, 2, 4)
SEQ = 16
VOCAB = 256


def _tiny_causal_lm(
    config_cls: str, model_cls: str, hidden: int, inter: int, layers: int, vocab: int, **extra: Any
) -> Any:
    import transformers

    config = getattr(transformers, config_cls)(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        use_cache=False,
        **extra,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config)


def tiny_llama(hidden: int = 64, inter: int = 128, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    return _tiny_causal_lm("LlamaConfig", "LlamaForCausalLM", hidden, inter, layers, vocab)


def tiny_mixtral(hidden: int = 64, inter: int = 96, layers: int = 2, vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny Mixtral (4 experts, top-2) for MoeHybridParallelPlugin."""
    return _tiny_causal_lm(
        "MixtralConfig", "MixtralForCausalLM", hidden, inter, layers, vocab, num_local_experts=4, num_experts_per_tok=2
    )


def model_for(plugin_name: str) -> torch.nn.Module:
    return tiny_mixtral() if plugin_name.startswith("Moe") else tiny_llama()


def make_optimizer(path: str, model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    """``path(model.parameters(), **kwargs)``; a ``galore`` entry in kwargs instead builds GaLore
    param groups (attention and MLP weights, the format galore_torch and ours share)."""
    module, name = path.rsplit(".", 1)
    kwargs = dict(kwargs)
    galore = kwargs.pop("galore", None)
    if galore is not None:
        from dist_optim import galore_param_groups

        return getattr(importlib.import_module(module), name)(galore_param_groups(model, **galore), **kwargs)
    return getattr(importlib.import_module(module), name)(model.parameters(), **kwargs)


def global_batch(step: int) -> torch.Tensor:
    """The same batch at a step whatever the layout, so runs at different dp sizes compare."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)


def rank_batch(step: int, dp_size: int, dp_rank: int) -> torch.Tensor:
    per = GLOBAL_BATCH // dp_size
    return global_batch(step)[dp_rank * per : (dp_rank + 1) * per]


def dp_coords(plugin: Any) -> tuple[int, int]:
    group = getattr(plugin, "dp_group", None)
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


def master_weights(model: Any, wrapper: Any) -> dict[str, torch.Tensor]:
    """Full fp32 weights by parameter name, gathered from the optimizer's masters and layouts."""
    from dist_optim import comm

    opt = wrapper.optim
    masters = [p for g in opt.param_groups for p in g["params"]]
    fulls = comm.gather_full([(opt.layout(p), p) for p in masters])
    to_working = wrapper.get_master_to_working_map() if hasattr(wrapper, "get_master_to_working_map") else None
    names = {id(p): n for n, p in model.unwrap().named_parameters()}
    out = {}
    for master, full in zip(masters, fulls):
        working = to_working[id(master)] if to_working else master
        out[names[id(working)]] = full.float()
    return out


def reference_run(
    opt_path: str,
    opt_kwargs: dict[str, Any],
    steps: int,
    low_precision: torch.dtype | None = None,
    pipeline: bool = False,
    plugin_name: str = "HybridParallelPlugin",
) -> dict[str, torch.Tensor]:
    """The single-process run. ``pipeline``: with the randomness the plugins choose under pipeline
    parallelism (layout-independent), parameters known by their model names as the plugins do."""
    import dist_optim

    model = model_for(plugin_name)
    if low_precision is not None:
        # The booster's fp32 masters start from the low-precision working weights.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(low_precision).float())
    opt = dist_optim.convert(make_optimizer(opt_path, model, opt_kwargs))
    opt.param_names = {p: n for n, p in model.named_parameters()}
    if pipeline:
        opt.use_layout_independent_randomness()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "stepping unbound in a multi-process job": on purpose
        for step in range(steps):
            x = global_batch(step)
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _boosted_run(
    plugin_name: str, plugin_kwargs: dict[str, Any], opt_path: str, opt_kwargs: dict[str, Any], steps: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any, Any]:
    """(initial weights, full fp32 weights of this rank's parameters after training, wrapper,
    plugin)."""
    from colossalai.booster import Booster

    from dist_optim import plugins

    with quiet_colossal():
        model = model_for(plugin_name)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = make_optimizer(opt_path, model, opt_kwargs)
        plugin = getattr(plugins, plugin_name)(**plugin_kwargs)
        booster = Booster(plugin=plugin)
        model, wrapper, *_ = booster.boost(model, optimizer)
        train_boosted(booster, model, wrapper, plugin, range(steps))
        return init, master_weights(model, wrapper), wrapper, plugin


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
    plugin_name: str, plugin_kwargs: dict[str, Any], opt_path: str, opt_kwargs: dict[str, Any], steps: int = 5
) -> dict[str, Any]:
    """Train through the booster; return errors against the single-process run (rank-local), and
    for MoE whether every expert parameter is bound to the MoE data-parallel group."""
    install()
    import dist_optim

    init, got, wrapper, plugin = _boosted_run(plugin_name, plugin_kwargs, opt_path, opt_kwargs, steps)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(plugin_kwargs.get("precision", "fp32"))
    if plugin_name == "LowLevelZeroPlugin" and "precision" not in plugin_kwargs:
        low = torch.float16
    expected = reference_run(
        opt_path, opt_kwargs, steps, low, pipeline=plugin_kwargs.get("pp_size", 1) > 1, plugin_name=plugin_name
    )
    opt = wrapper.optim
    errors = {}
    # Under pipeline parallelism a rank holds its stage's parameters only.
    for name in got:
        ref = expected[name]
        start = init[name] if low is None else init[name].to(low).float()
        delta = (ref - start).norm().item()
        errors[name] = {
            # error relative to the parameter's scale, and to the size of the training update
            "rel": ((got[name] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item(),
            "update_rel": ((got[name] - ref).norm() / max(delta, 1e-12)).item(),
        }
    masters = [p for g in opt.param_groups for p in g["params"]]
    return {
        "swapped_to": [c.__name__ for c in type(opt).__mro__],
        "is_dist_optim": isinstance(opt, dist_optim.DistOptimizer),
        "tp_bound": sum(opt.layout(p).tp is not None for p in masters),
        "zero_bound": sum(opt.layout(p).zero is not None for p in masters),
        "zero_sizes": sorted({opt.layout(p).zero.size for p in masters if opt.layout(p).zero is not None}),
        "experts_on_moe_group": _experts_on_moe_group(opt, plugin),
        "errors": errors,
        "all_names": sorted(expected),
    }
