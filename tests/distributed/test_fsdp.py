"""PyTorch FSDP's fragments read as flat-range layouts (plugins/fsdp.py), and what
dist_optim.plugins.TorchFSDPPlugin keeps that ColossalAI's plugin drops. Parity, checkpoints and
resharding on FSDP are the support table's (tests/distributed/test_booster.py, test_checkpoint.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dist_optim.testing import tiny_llama


# ---- workers (every rank) ----------------------------------------------------------------------
def _fsdp(model: torch.nn.Module, per_layer: bool, **kwargs: Any) -> Any:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy = ModuleWrapPolicy({LlamaDecoderLayer}) if per_layer else None
    return FSDP(model, device_id=torch.device("cpu"), auto_wrap_policy=policy, **kwargs)


def _odd_model() -> torch.nn.Module:
    """Parameters of 35, 7 and 21 elements: FSDP pads between them (16-byte alignment) and at the
    end (a multiple of the world size)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3, bias=False))


def fragments(kind: str) -> dict[str, Any]:
    """Each parameter's fragment against its layout's piece of the parameter before wrapping,
    read from the unwrapped model, not through the layouts."""
    per_layer = kind == "per-layer"
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from dist_optim.plugins.fsdp import aligned_numel, flat_param_bounds, fsdp_layouts, fsdp_units

    model = _odd_model() if kind == "odd" else tiny_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # FSDP's rule as the planner applies it to a model it never wraps
    units = fsdp_units(model, {LlamaDecoderLayer} if per_layer else set())
    derived = flat_param_bounds(units.values(), torch.distributed.get_world_size(), aligned_numel(torch.float32))
    wrapped = _fsdp(model, per_layer, use_orig_params=True)
    binding = fsdp_layouts(wrapped)
    wrong, empty, split, rule = [], 0, 0, []
    for p in wrapped.parameters():
        name = binding.names[p]
        layout = binding.layouts[p]
        if layout.zero is None or not torch.equal(layout.take_local(before[name]), p.detach().reshape(-1)):
            wrong.append(name)
        elif layout.zero.bounds != derived[name]:
            rule.append(name)
        empty += p.numel() == 0
        split += 0 < p.numel() < layout.full_numel
    return {
        "wrong": wrong,
        "rule": rule,
        "units": len(units),
        "names": sorted(binding.names.values()) == sorted(before),
        "empty": empty,
        "split": split,
    }


def flat_parameters_refused() -> str:
    from dist_optim.plugins.fsdp import fsdp_layouts

    try:
        fsdp_layouts(_fsdp(tiny_llama(), False))
    except ValueError as e:
        return str(e)
    return "no error"


def stepped_on_flat_parameters() -> str:
    """What a stock TorchFSDPPlugin does with our optimizer: re-create it on FSDP's flat
    parameters (without use_orig_params), then step."""
    import dist_optim

    model = _fsdp(tiny_llama(), False)
    opt = dist_optim.DistributedLamb(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    model(input_ids=x, labels=x).loss.backward()
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return "no error"


def boosted_groups_and_clipping(max_norm: float) -> dict[str, Any]:
    """Boost a two-group transformers Adafactor with our plugin; clip the gradients of one batch
    (the same on every rank, so FSDP's average is the single-process gradient)."""
    import transformers
    from colossalai.booster import Booster

    from dist_optim import comm, plugins
    from dist_optim.plugins.cpu import install, quiet_colossal

    install()
    with quiet_colossal():
        model = tiny_llama()
        reference = tiny_llama()
        norms = [p for n, p in model.named_parameters() if "norm" in n]
        rest = [p for n, p in model.named_parameters() if "norm" not in n]
        opt = transformers.optimization.Adafactor(
            [{"params": rest, "lr": 1e-2}, {"params": norms, "lr": 1e-3}], relative_step=False, scale_parameter=False
        )
        boosted, wrapper, *_ = Booster(plugin=plugins.TorchFSDPPlugin()).boost(model, opt)
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
        boosted(input_ids=x, labels=x).loss.backward()
        total = float(wrapper.clip_grad_by_norm(max_norm))
        optim = wrapper.optim
        params = [p for g in optim.param_groups for p in g["params"]]
        # FSDP leaves an empty fragment's gradient None (the wrapper fills it in at step)
        grads = [p.grad if p.grad is not None else torch.empty_like(p) for p in params]
        clipped = comm.gather_full([(optim.layout(p), g) for p, g in zip(params, grads)])
        reference(input_ids=x, labels=x).loss.backward()
        ref_total = float(torch.nn.utils.clip_grad_norm_(list(reference.parameters()), max_norm))
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        worst = max(
            float((g - ref_grads[optim.param_names[p]]).abs().max() / ref_grads[optim.param_names[p]].abs().max())
            for p, g in zip(params, clipped)
        )
        return {
            "groups": [(len(g["params"]), g["lr"]) for g in optim.param_groups],
            "expected_groups": [(len(rest), 1e-2), (len(norms), 1e-3)],
            "norm_rel": abs(total - ref_total) / ref_total,
            "clipped_rel": worst,
        }


def strategy_parity(strategy: str) -> dict[str, float]:
    """LAMB (norms over each parameter's fragments), Muon (owners gather whole matrices) and
    Adafactor (row and column sums, the parameter's RMS), each
    boosted through our TorchFSDPPlugin with FSDP's sharding ``strategy`` (the hybrid ones shard
    over rank pairs and replicate across them, the process groups FSDP takes for that), 3 steps on
    the same batches on every rank, against the same optimizer unbound on one model: per optimizer,
    the largest parameter difference relative to the largest parameter, read from the gathered
    fragments and the reference model."""
    from colossalai.booster import Booster
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import dist_optim
    from dist_optim import comm, plugins
    from dist_optim.plugins.cpu import install, quiet_colossal
    from dist_optim.testing import grid_groups

    install()
    kwargs: dict[str, Any] = {"sharding_strategy": getattr(ShardingStrategy, strategy)}
    if "HYBRID" in strategy:
        kwargs["process_group"] = grid_groups(2, 2)  # (shard over [0, 1] / [2, 3], replicate across)
    makers = {
        "lamb": lambda m: dist_optim.DistributedLamb(m.parameters(), lr=1e-2, weight_decay=0.01),
        "muon": lambda m: dist_optim.DistributedMuon(dist_optim.muon_param_groups(m), lr=2e-2),
        # the parameter's RMS scales the step: a sum over the wrong ranks changes it
        "adafactor": lambda m: dist_optim.DistributedAdafactor(m.parameters(), lr=1e-2, relative_step=False),
    }
    out = {}
    with quiet_colossal():
        for name, make in makers.items():
            model, reference = tiny_llama(), tiny_llama()
            policy = ModuleWrapPolicy({LlamaDecoderLayer})
            plugin = plugins.TorchFSDPPlugin(auto_wrap_policy=policy, **kwargs)
            boosted, wrapper, *_ = Booster(plugin=plugin).boost(model, make(model))
            ref_opt = make(reference)
            for step in range(3):
                x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
                boosted(input_ids=x, labels=x).loss.backward()
                wrapper.step()
                wrapper.zero_grad()
                reference(input_ids=x, labels=x).loss.backward()
                ref_opt.step()
                ref_opt.zero_grad()
            optim = wrapper.optim
            params = [p for g in optim.param_groups for p in g["params"]]
            full = comm.gather_full([(optim.layout(p), p.detach()) for p in params])
            ref = {n: p.detach() for n, p in reference.named_parameters()}
            scale = max(float(v.abs().max()) for v in ref.values())
            worst = max(float((f - ref[optim.param_names[p]]).abs().max()) for p, f in zip(params, full))
            out[name] = worst / scale
    return out


# ---- tests --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["one-unit", "per-layer", "odd"])
def test_layouts_locate_fsdp_fragments(pool4, kind) -> None:
    """Every fragment FSDP hands a rank is its layout's piece of the parameter, whether one FSDP
    unit holds the model or each decoder layer is a unit; some fragments are empty, some cut. The
    ranges are those FSDP's layout rule gives the unwrapped model (what the planner simulates)."""
    results = pool4.run(fragments, kind)
    for rank, res in enumerate(results):
        assert not res["wrong"] and res["names"], (rank, res["wrong"][:5])
        assert not res["rule"], (rank, res["rule"][:5])
        assert res["units"] == (3 if kind == "per-layer" else 1)
    assert sum(r["empty"] for r in results) > 0 and sum(r["split"] for r in results) > 0


def test_flat_parameters_are_refused(pool4) -> None:
    """FSDP without use_orig_params hands an optimizer flat parameters mixing tensors: refused,
    naming the fix."""
    for message in pool4.run(flat_parameters_refused):
        assert "use_orig_params=True" in message and "\n" not in message, message


def test_stepping_on_flat_parameters_is_refused(pool4) -> None:
    """Our optimizer re-created on FSDP's flat parameters (a stock TorchFSDPPlugin without the
    launcher) refuses its first step, naming our plugin and the launcher."""
    for message in pool4.run(stepped_on_flat_parameters):
        assert "dist_optim.plugins.TorchFSDPPlugin" in message and "launch" in message, message


def test_plugin_keeps_groups_and_clips_by_the_global_norm(pool4) -> None:
    """ColossalAI's TorchFSDPPlugin re-creates the optimizer with one group and its defaults, and
    clips each rank's fragments by their own norm; ours keeps the user's groups and clips by the
    whole model's norm, as one process does (fp32: measured identical; asserted within 1e-5)."""
    for res in pool4.run(boosted_groups_and_clipping, 0.01):
        assert res["groups"] == res["expected_groups"], res["groups"]
        assert res["norm_rel"] < 1e-5 and res["clipped_rel"] < 1e-5, res


@pytest.mark.parametrize("strategy", ["NO_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"])
def test_every_sharding_strategy_steps_as_one_process(pool4, strategy: str) -> None:
    """FSDP's other sharding strategies (FULL_SHARD is the support table's column): replicated
    parameters (NO_SHARD), fragments kept between steps (SHARD_GRAD_OP), and fragments over a
    shard group replicated across another (the hybrid ones) all bind so that each step is the
    single-process one. fp32 on both sides, the same operations but LAMB's norms summed in another
    order: measured 1.2e-7 of the largest parameter at most, asserted within 1e-6."""
    for rank, res in enumerate(pool4.run(strategy_parity, strategy)):
        assert all(v <= 1e-6 for v in res.values()), (strategy, rank, res)
