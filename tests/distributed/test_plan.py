"""The planner against real runs: a tiny Llama boosted by dist_optim.plugins on gloo processes,
every optimizer, tp=2 x dp=2 x ZeRO-1, pp=2 x dp=2 x ZeRO-1, sp=2 x dp=2 x ZeRO-1 (all_to_all),
LowLevelZero ZeRO-2 x 4, DDP x 2, FSDP x 4 and Gemini x 4. For every rank and
every step, the optimizer state bytes, the collectives (by kind) and the bytes sent that the
planner simulates on meta tensors equal what the run measures; the peak transient bytes of a
step are within 10%; the tensors and layouts the planner hands the optimizer are the ones the
plugin bound. The run is measured with the tests' own instruments (tests/helpers/collectives.py,
tests/helpers/allocated.py), never with the planner's: a miscount in the planner cannot be
repeated on the measured side."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import dist_optim
from dist_optim.plan import Layout, PlanError, Workload, make_plan, parse_bytes
from dist_optim.plan.simulate import COLUMNS, OPTIMIZERS, SimWorld, build_optimizer, build_pieces
from dist_optim.plan.traffic import LiveBytes
from dist_optim.plan.world import ChunkSearch
from dist_optim.testing import tiny_llama
from tests.helpers.allocated import AllocatedBytes, held_bytes
from tests.helpers.booster import GEMINI_CHUNKS, GLOBAL_BATCH, SEQ, balance_router, model_for, rank_batch
from tests.helpers.collectives import Collectives, counting_collectives

STEPS = 3

#: (plugin class, its CPU kwargs, pool size, the planner's Layout)
LAYOUTS = {
    "tp2-dp2-zero1": (
        "HybridParallelPlugin",
        dict(tp_size=2, pp_size=1, zero_stage=1, precision="bf16", overlap_communication=False),
        4,
        Layout("hybrid", tp=2, zero=1, dp=2, precision="bf16"),
    ),
    "pp2-dp2-zero1": (
        "HybridParallelPlugin",
        dict(tp_size=1, pp_size=2, zero_stage=1, precision="bf16", overlap_communication=False, microbatch_size=1),
        4,
        Layout("hybrid", pp=2, zero=1, dp=2, precision="bf16"),
    ),
    "sp2-dp2-zero1": (
        "HybridParallelPlugin",
        dict(
            tp_size=1,
            pp_size=1,
            zero_stage=1,
            precision="bf16",
            overlap_communication=False,
            sp_size=2,
            enable_sequence_parallelism=True,
            sequence_parallelism_mode="all_to_all",
        ),  # fmt: skip
        4,
        Layout("hybrid", sp=2, zero=1, dp=2, precision="bf16"),
    ),
    "zero2-x4": (
        "LowLevelZeroPlugin",
        dict(stage=2, precision="bf16", overlap_communication=False),
        4,
        Layout("zero", zero=2, dp=4, precision="bf16"),
    ),
    "ddp-x2": ("TorchDDPPlugin", {}, 2, Layout("ddp", dp=2, precision="fp32")),
}

#: A tiny Mixtral under MoeHybridParallelPlugin: its 4 experts over ep=2, ZeRO-1 over the MoE
#: data-parallel group (2 ranks) for the experts and over all 4 for the rest; run with the
#: optimizers of MOE_OPTIMIZERS only (each case is a 4-process run).
MOE_LAYOUT = (
    "MoeHybridParallelPlugin",
    dict(tp_size=1, pp_size=1, ep_size=2, zero_stage=1, precision="bf16", overlap_communication=False),
    4,
    Layout("hybrid", dp=4, ep=2, zero=1, precision="bf16"),
)
#: LAMB: norms of each tensor over its own ZeRO group; Shampoo: owners and routes within each group.
MOE_OPTIMIZERS = ("lamb", "shampoo")

#: ZeRO-2 over 4 ranks with CPU offload: every collective of the optimizer is staged through the
#: (simulated, tests/conftest.py) accelerator; the bytes staged per step, measured by the staging
#: itself (dist_optim.comm.rules.STAGED, whose count test_collective_rules.py checks by hand), must
#: be the plan's. The optimizers with the most varied collectives: norms, owners' routes, buckets.
OFFLOAD_LAYOUT = (
    "LowLevelZeroPlugin",
    dict(stage=2, precision="bf16", overlap_communication=False, cpu_offload=True),
    4,
    Layout("zero", zero=2, dp=4, precision="bf16", cpu_offload=True),
)
OFFLOAD_OPTIMIZERS = ("lamb", "galore", "shampoo", "muon", "kron")

CASES = [
    pytest.param(name, layout_id, LAYOUTS[layout_id], id=f"{name}-{layout_id}")
    for layout_id in LAYOUTS
    for name in COLUMNS
] + [pytest.param(name, "moe-ep2-zero1", MOE_LAYOUT, id=f"{name}-moe-ep2-zero1") for name in MOE_OPTIMIZERS]
CASES += [
    pytest.param(name, "zero2-x4-offload", OFFLOAD_LAYOUT, id=f"{name}-zero2-x4-offload") for name in OFFLOAD_OPTIMIZERS
]


def _decoder_layers() -> Any:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return ModuleWrapPolicy({LlamaDecoderLayer})


#: FSDP's full shard over 4 ranks, a unit per decoder layer as the recipe wraps: every parameter a
#: flat range of its unit, empty on most ranks; the planner derives the ranges by FSDP's rule.
FSDP_LAYOUT = ("TorchFSDPPlugin", dict(auto_wrap_policy=_decoder_layers()), 4, Layout("fsdp", dp=4, precision="fp32"))
CASES += [pytest.param(name, "fsdp-x4", FSDP_LAYOUT, id=f"{name}-fsdp-x4") for name in COLUMNS]
#: Gemini's static placement over 4 ranks, bf16, with the tests' chunk search (chunks of the
#: embedding's size, each cut into 4 shards): every parameter a range of its chunk's shard on a
#: rank, cut anywhere, empty on most; the planner runs ColossalAI's chunk search on the meta model.
#: Every column but torch's AdamW, which ColossalAI's Gemini refuses (it takes its own Adam classes only).
GEMINI_LAYOUT = (
    "GeminiPlugin",
    dict(GEMINI_CHUNKS, placement_policy="static", precision="bf16"),
    4,
    Layout("gemini", dp=4, precision="bf16", chunk_search=ChunkSearch(**GEMINI_CHUNKS)),
)
CASES += [pytest.param(name, "gemini-x4", GEMINI_LAYOUT, id=f"{name}-gemini-x4") for name in COLUMNS if name != "adamw"]
#: GeminiPlugin's own chunk search, which keeps a model this small in one chunk whole on every rank.
GEMINI_KEPT_LAYOUT = (
    "GeminiPlugin",
    dict(placement_policy="static", precision="bf16"),
    4,
    Layout("gemini", dp=4, precision="bf16"),
)
CASES += [
    pytest.param(name, "gemini-kept-x4", GEMINI_KEPT_LAYOUT, id=f"{name}-gemini-kept-x4")
    for name in ("lamb", "shampoo")
]
#: The catalogue's variants (its entries that are not columns), each checked on one layout: Shampoo's
#: code with a few options changed (SOAP: Adam's moments in the eigenbasis, rotated at a refresh).
CASES += [
    pytest.param(name, "tp2-dp2-zero1", LAYOUTS["tp2-dp2-zero1"], id=f"{name}-tp2-dp2-zero1")
    for name in OPTIMIZERS
    if name not in COLUMNS
]


#: Optimizer options for the tiny model (GaLore's default rank 128 exceeds its 64-wide matrices;
#: its bucket_bytes of 16 KiB makes each refresh and each step run several buckets).
#: LAMB's foreach=None picks per-tensor kernels on the CPU and foreach ones on an accelerator (the
#: path the planner simulates): the test runs the accelerator's path on the CPU, like with like.
#: The owner optimizers take a step-memory budget small enough that every step runs in several
#: buckets (asserted below), so that the planner is checked on the bucketed, pipelined exchange.
BUDGET = {"bucket_bytes": 20_000}
ARGS: dict[str, dict[str, Any]] = {
    "galore": {"galore": {"rank": 8}, "bucket_bytes": 16384},
    "lamb": {"foreach": True, "bucket_bytes": 2**14},
    "shampoo": BUDGET,
    "soap": BUDGET,
    "muon": BUDGET,
    "normuon": BUDGET,
    "kron": BUDGET,
}
#: The optimizers whose every step must show several buckets (more exchanges than one bucket has).
BUCKETED = {"shampoo", "soap", "muon", "normuon", "kron"}

#: The planner's name for each torch.distributed collective (it names what dist_optim.comm does);
#: a collective missing here keeps its torch name, which no planned kind has: the comparison fails.
PLANNED_KIND = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "all_gather_object": "all_gather_object",
    "barrier": "barrier",
}

#: Object collectives carry planning metadata (which pieces a rank holds), exchanged when an
#: optimizer plans its routes: the planner counts the call and leaves its pickled bytes out of a
#: step's bytes sent. The run measures them (tests/helpers/collectives.py) and reports them apart.
OBJECT_KINDS = {"all_gather_object"}


def _measured_run(name: str, plugin_name: str, plugin_kwargs: dict[str, Any]) -> dict[str, Any]:
    """On every rank: boost the tiny Llama with optimizer ``name`` built as the planner builds it,
    train STEPS steps, and measure each ``optimizer.step()`` on real tensors with the tests' own
    instruments: every torch.distributed collective it issues (through dist_optim.comm or not) and
    the bytes it allocates; then the bytes its state holds. Also what the optimizer steps: its
    tensors' shapes and, when it is a dist_optim optimizer, whether it is bound and the layout of
    each tensor."""
    from colossalai.booster import Booster

    from dist_optim import plugins
    from dist_optim.comm import rules
    from dist_optim.plugins.cpu import install, quiet_colossal
    from tests.helpers.booster import dp_coords

    install()
    with quiet_colossal():
        model = model_for(plugin_name)
        opt = build_optimizer(name, model, dict(model.named_parameters()), ARGS.get(name))
        plugin = getattr(plugins, plugin_name)(**plugin_kwargs)
        booster = Booster(plugin=plugin)
        model, wrapper, *_ = booster.boost(model, opt)
        inner = wrapper.optim
        real_step = inner.step
        measured: list[dict[str, Any]] = []

        def step(*args: Any, **kwargs: Any) -> Any:
            rules.reset_staged()
            with counting_collectives() as seen, AllocatedBytes() as live:
                out = real_step(*args, **kwargs)
            measured.append(
                dict(_step_record(seen, live.peak - live.live, live.largest), staged=sum(rules.STAGED.values()))
            )
            return out

        inner.step = step
        _accelerator_workspaces(inner)
        dp_size, dp_rank = dp_coords(plugin)
        for s in range(STEPS):
            x = rank_batch(s, dp_size, dp_rank)
            if plugin_kwargs.get("pp_size", 1) > 1:
                batch = iter([{"input_ids": x, "labels": x}])
                booster.execute_pipeline(batch, model, lambda out, _: out.loss, wrapper, return_loss=True)
            else:
                mask = {"attention_mask": torch.ones_like(x)} if plugin_kwargs.get("sp_size", 1) > 1 else {}
                booster.backward(model(input_ids=x, labels=x, **mask).loss, wrapper)
            wrapper.step()
            wrapper.zero_grad()
        params = [p for g in inner.param_groups for p in g["params"]]
        bound = hasattr(inner, "layout")  # a dist_optim optimizer; torch's AdamW passes through
        return {
            "steps": measured,
            "state": held_bytes(list(inner.state.values())),
            "optimizer": type(inner).__name__,
            "shapes": [tuple(p.shape) for p in params],
            "bound": bound and inner.is_bound,
            "layouts": [_layout_key(inner.layout(p)) for p in params] if bound else None,
        }


def _accelerator_workspaces(opt: Any) -> None:
    """Adafactor and CAME keep one scratch buffer across steps on the CPU only (page faults cost
    more there than the arithmetic); on an accelerator each workspace is a fresh tensor, which is
    the path the planner simulates (a meta tensor is not a CPU tensor). The measured CPU run takes
    the accelerator's branch, so that the transient compares like with like."""
    if hasattr(opt, "_workspace"):
        opt._workspace = lambda like: torch.empty(like.shape, dtype=torch.promote_types(like.dtype, torch.float32))


def _layout_key(layout: Any) -> tuple:
    tp = None if layout.tp is None else (layout.tp.dim, layout.tp.size, layout.tp.rank)
    zero = (
        None if layout.zero is None else (layout.zero.size, layout.zero.rank, layout.zero.padding, layout.zero.bounds)
    )
    return (layout.full_shape, tp, zero)


def _step_record(seen: Collectives, transient: int, largest: int) -> dict[str, Any]:
    """One measured step: {planned kind: (calls, bytes sent)} (None for the bytes of object
    collectives, which the planner leaves out), their pickled bytes, the transient, the largest buffer."""
    by_kind = {
        PLANNED_KIND.get(kind, kind): (n, None if kind in OBJECT_KINDS else float(seen.sent[kind]))
        for kind, n in seen.counts.items()
    }
    objects = float(sum(seen.sent[kind] for kind in OBJECT_KINDS))
    return {"by_kind": by_kind, "object_bytes": objects, "transient": transient, "largest": largest}


def _planned_step(step: dict[str, Any]) -> dict[str, tuple[int, float | None]]:
    """A planned step as {kind: (calls, bytes sent)}, None for the bytes of object collectives."""
    sent = step["bytes_by_kind"]
    return {kind: (n, None if kind in OBJECT_KINDS else sent[kind]) for kind, n in step["by_kind"].items()}


@pytest.fixture(scope="module")
def tiny_config() -> Any:
    return tiny_llama().config


@pytest.mark.parametrize("name,layout_id,case", CASES)
def test_plan_equals_the_run(name: str, layout_id: str, case: tuple, request: pytest.FixtureRequest) -> None:
    """On every rank, the plan (make_plan, every rank simulated) against the run measured with
    tests/helpers: the optimizer state bytes are equal; at every step, the collectives by kind,
    and the bytes sent by each kind and in all, are equal (object collectives: the calls; the
    planner leaves their pickled bytes out); the tensors the optimizer steps have the shapes of the
    planner's pieces, in the optimizer's order; a dist_optim optimizer is bound to exactly the
    planner's layouts (under DDP whole and local ones, TP and ZeRO nowhere), torch's AdamW is not
    bound and has no layouts; the peak transient per rank is within 10% plus one buffer."""
    plugin_name, kwargs, procs, layout = case
    pool = request.getfixturevalue("pool4" if procs == 4 else "pool2")
    measuring = pool.submit(_measured_run, name, plugin_name, kwargs)
    try:  # the plan is simulated here while the workers measure the run
        tiny_config = model_for(plugin_name).config
        plan = make_plan(tiny_config, layout, name, ARGS.get(name), steps=STEPS, device="cpu")
    finally:
        runs = measuring.result()
    assert [r.rank for r in plan.ranks] == list(range(procs))  # every rank of a small world is simulated

    off: list[tuple[int, int, int, int, int]] = []
    for rank, run in enumerate(runs):
        planned = plan.ranks[rank]
        assert planned.optimizer_state == run["state"], f"rank {rank}: state bytes"
        got = [(_planned_step(s), s["bytes_sent"]) for s in planned.steps]
        want = [(m["by_kind"], _tensor_bytes(m["by_kind"])) for m in run["steps"]]
        assert got == want, f"rank {rank}: per step ({{kind: (collectives, bytes sent)}}, bytes sent): plan != run"
        for s, m in zip(planned.steps, run["steps"]):
            off.append((rank, s["step"], s["transient"], m["transient"], m["largest"]))
        _check_layouts(tiny_config, layout, name, rank, run)
        if layout.cpu_offload:
            staged = [(s["staged"], m["staged"]) for s, m in zip(planned.steps, run["steps"])]
            assert all(a == b > 0 for a, b in staged), f"rank {rank}: bytes staged per step (plan, run): {staged}"
        if name in BUCKETED:
            # one bucket moves its tensors in at most one all_to_all per work group and direction
            # (routed) or one all_gather per group (gathered, shared): one work group here
            moving = [sum(m["by_kind"].get(k, (0, 0))[0] for k in ("all_to_all", "all_gather")) for m in run["steps"]]
            assert min(moving) > 2, f"rank {rank}: all_to_all + all_gather per step {moving}: not several buckets"
    objects = [[m["object_bytes"] for m in run["steps"]] for run in runs]
    print(f"pickled bytes of object collectives per rank and step (not in the plan's bytes): {objects}")
    print(f"transient (rank, step, planned, measured, largest buffer): {off}")
    # The peak over the steps, per rank (what the planner reports), within 10% plus one buffer: in a
    # measured gloo run the moment a temporary is released varies from run to run (seen: one step of
    # one rank 180 KB above or below the simulation in repeated runs, every other step exact to the
    # byte), which a simulation cannot reproduce.
    bad = []
    for rank in range(procs):
        mine = [o for o in off if o[0] == rank]
        planned_peak, measured_peak = max(o[2] for o in mine), max(o[3] for o in mine)
        if abs(planned_peak - measured_peak) > 0.10 * max(measured_peak, 1) + max(o[4] for o in mine):
            bad.append((rank, planned_peak, measured_peak))
    assert not bad, f"peak transient off by more than 10% + one buffer (rank, planned, measured): {bad}"


def _tensor_bytes(by_kind: dict[str, tuple[int, float | None]]) -> float:
    return sum(sent for _, sent in by_kind.values() if sent is not None)


def _check_layouts(config: Any, layout: Layout, name: str, rank: int, run: dict[str, Any]) -> None:
    """What the planner hands the optimizer on ``rank`` (its pieces: ShardFormer's TP split,
    LowLevelZero's padding) against what the plugin handed it in the run."""
    with SimWorld(layout, rank) as world:
        _, pieces = build_pieces(config, layout, world)
    pieces = _in_group_order(pieces, name, config)
    where = f"rank {rank}"
    assert [tuple(p.master.shape) for p in pieces] == run["shapes"], f"{where}: the tensors the optimizer steps"
    planned = [_layout_key(p.layout) for p in pieces]
    if layout.plugin == "ddp":
        whole = [(tuple(p.master.shape), None, None) for p in pieces]
        assert planned == whole, f"{where}: the planner's DDP layouts are whole and local"
    if name == "adamw":
        # Element-wise and exact on any piece: the plugin passes torch's AdamW through unbound.
        assert run["optimizer"] == "AdamW" and not run["bound"] and run["layouts"] is None, where
    else:
        assert run["bound"], f"{where}: the plugin bound {run['optimizer']}"
        assert run["layouts"] == planned, f"{where}: the layouts the plugin bound"


def _in_group_order(pieces: list[Any], name: str, config: Any) -> list[Any]:
    """``pieces`` in the optimizer's param-group order (GaLore and Muon regroup them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    opt = build_optimizer(name, model, {p.name: p.master for p in pieces}, ARGS.get(name))
    by_master = {id(p.master): p for p in pieces}
    return [by_master[id(m)] for g in opt.param_groups for m in g["params"]]


def _measured_training_step(plugin_name: str, plugin_kwargs: dict[str, Any]) -> list[float]:
    """Bytes this rank sends in each of two training steps (forward, backward, torch's AdamW
    stepped through the plugin's wrapper), every torch.distributed collective counted."""
    from colossalai.booster import Booster

    from dist_optim import plugins
    from dist_optim.plugins.cpu import install, quiet_colossal
    from tests.helpers.booster import dp_coords

    install()
    with quiet_colossal():
        model = model_for(plugin_name)
        plugin = getattr(plugins, plugin_name)(**plugin_kwargs)
        booster = Booster(plugin=plugin)
        model, wrapper, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    dp_size, dp_rank = dp_coords(plugin)
    if "ep_size" in plugin_kwargs:  # route as the plan does: the tokens' all-to-alls are then its
        balance_router(model, GLOBAL_BATCH // dp_size * SEQ)
    sent = []
    for s in range(2):
        x = rank_batch(s, dp_size, dp_rank)
        with counting_collectives() as seen:
            booster.backward(model(input_ids=x, labels=x).loss, wrapper)
            wrapper.step()
            wrapper.zero_grad()
        sent.append(float(seen.bytes_sent))
    return sent


@pytest.mark.parametrize("layout_id", ["tp2-dp2-zero1", "zero2-x4", "moe-ep2-zero1"])
def test_step_traffic_equals_the_run(layout_id: str, pool4: Any) -> None:
    """A training step's bytes sent per rank, as the plan adds them up (the model's collectives,
    simulated; the ZeRO gradient reduction and parameter all-gather, derived), against every
    collective of a real step counted at torch.distributed (AdamW, which sends nothing itself):
    equal but for the overflow flag ZeRO all-reduces (one scalar, at most 8 bytes sent; under
    MoeHybridParallelPlugin one per ZeRO group, experts' and the rest's). The Mixtral's router is
    balanced as the plan's (tests/helpers/booster.py balance_router): its tokens' all-to-alls to the
    experts and back are then the plan's."""
    plugin_name, kwargs, _, layout = MOE_LAYOUT if layout_id == "moe-ep2-zero1" else LAYOUTS[layout_id]
    measuring = pool4.submit(_measured_training_step, plugin_name, kwargs)
    try:
        work = Workload(SEQ, GLOBAL_BATCH // layout.dp if layout.plugin == "hybrid" else GLOBAL_BATCH // layout.world)
        plan = make_plan(model_for(plugin_name).config, layout, "adamw", steps=2, device="cpu", workload=work)
    finally:
        runs = measuring.result()
    planned = plan.step_traffic["total"]
    flags = 2 if layout.ep > 1 else 1
    for rank, sent in enumerate(runs):
        for step, measured in enumerate(sent):
            assert 0 <= measured - planned <= 8 * flags, f"rank {rank} step {step}: run sent {measured}, plan {planned}"


def _measured_gemini_step(plugin_kwargs: dict[str, Any], checkpointed: bool) -> list[dict[str, tuple[int, float]]]:
    """The collectives of this rank's forward and backward (by kind: calls, bytes sent) in each of
    three training steps of the tiny Llama under GeminiPlugin, LAMB stepped between them; its
    decoder layers ``checkpointed`` as the recipe does it, or not."""
    from colossalai.booster import Booster

    from dist_optim import plugins
    from dist_optim.plugins.cpu import install, quiet_colossal
    from tests.helpers.booster import dp_coords

    install()
    with quiet_colossal():
        model = model_for("GeminiPlugin")
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = build_optimizer("lamb", model, dict(model.named_parameters()), ARGS["lamb"])
        plugin = plugins.GeminiPlugin(**plugin_kwargs)
        booster = Booster(plugin=plugin)
        model, wrapper, *_ = booster.boost(model, opt)
    dp_size, dp_rank = dp_coords(plugin)
    out = []
    for s in range(STEPS):
        x = rank_batch(s, dp_size, dp_rank)
        with counting_collectives() as seen:
            booster.backward(model(input_ids=x, labels=x).loss, wrapper)
        out.append({kind: (n, float(seen.sent[kind])) for kind, n in seen.counts.items()})
        wrapper.step()
        wrapper.zero_grad()
    return out


@pytest.mark.parametrize("layout_id", ["gemini-x4", "gemini-x4-checkpointed", "gemini-kept-x4"])
def test_gemini_chunk_traffic_equals_the_run(layout_id: str, pool4: Any) -> None:
    """Gemini's collectives in a training step's forward and backward (the chunks' all-gathers,
    some chunks gathered more than once, again for a checkpointed layer's recomputation, and
    gradient reduce-scatters; a kept chunk's all-reduce), as the plan derives them
    (Plan.step_traffic's ``gradients``), against every collective of a real forward and backward
    counted at torch.distributed."""
    plugin_name, kwargs, _, layout = GEMINI_KEPT_LAYOUT if layout_id == "gemini-kept-x4" else GEMINI_LAYOUT
    checkpointed = layout_id.endswith("checkpointed")
    measuring = pool4.submit(_measured_gemini_step, kwargs, checkpointed)
    try:
        work = Workload(SEQ, GLOBAL_BATCH // layout.world, grad_checkpoint=checkpointed)
        config = model_for(plugin_name).config
        plan = make_plan(config, layout, "lamb", ARGS["lamb"], steps=2, device="cpu", workload=work)
    finally:
        runs = measuring.result()
    planned = plan.step_traffic["gradients"]
    for rank, steps in enumerate(runs):
        for step, by_kind in enumerate(steps):
            measured = sum(sent for _, sent in by_kind.values())
            assert measured == planned, f"rank {rank} step {step}: run sent {measured} ({by_kind}), plan {planned}"


def test_bad_input_names_the_option_and_the_fix() -> None:
    with pytest.raises(PlanError, match="--tp 2 needs --plugin hybrid"):
        Layout("zero", tp=2, zero=1, dp=2)
    with pytest.raises(PlanError, match="^--pp 2 needs --plugin hybrid"):
        Layout("zero", pp=2, zero=1, dp=2)
    with pytest.raises(PlanError, match="^--zero 2 with --pp 2: HybridParallelPlugin takes ZeRO 0 or 1"):
        Layout("hybrid", pp=2, zero=2, dp=2)
    with pytest.raises(PlanError, match="^--sp 2 needs --plugin hybrid without --pp"):
        Layout("hybrid", pp=2, sp=2)
    with pytest.raises(PlanError, match="^--zero 1 with --precision fp32: HybridParallelPlugin's ZeRO takes bf16"):
        Layout("hybrid", zero=1, dp=2, precision="fp32")
    with pytest.raises(PlanError, match="^--cpu-offload is ZeRO's .*: add --zero 1 or --zero 2"):
        Layout("hybrid", tp=2, cpu_offload=True)
    # Gemini: what dist_optim runs under it (static placement without offload, tp_size=1) and what
    # GeminiPlugin takes (bf16/fp16), each refused in one line naming the fix
    for kwargs, refusal in (
        (dict(tp=2, dp=2), "^--tp 2 with --plugin gemini: .*; plan --plugin hybrid --tp 2 --zero 1"),
        (dict(pp=2, dp=2), "^--pp 2 needs --plugin hybrid"),
        (dict(dp=4, cpu_offload=True), "^--cpu-offload with --plugin gemini: .*; plan --plugin zero --zero 2"),
        (dict(dp=4, zero=2), "^--zero 2 with --plugin gemini: .*; plan --plugin gemini without --zero"),
        (dict(dp=4, precision="fp32"), "^--precision fp32 with --plugin gemini: .*; plan --precision bf16"),
    ):
        with pytest.raises(PlanError, match=refusal):
            Layout("gemini", **kwargs)
    with pytest.raises(
        PlanError, match="^--plugin gemini with a mixture-of-experts model: .*; plan --plugin hybrid --ep"
    ):
        make_plan(model_for("MoeHybridParallelPlugin").config, Layout("gemini", dp=4), "lamb", device="cpu")
    with pytest.raises(PlanError, match="^--min-chunk-size-m, .* are Gemini's chunk search: add --plugin gemini"):
        Layout("zero", zero=2, dp=4, chunk_search=ChunkSearch(min_chunk_size_m=0))
    with pytest.raises(PlanError, match="--optimizer 'adam': choose one of"):
        make_plan("llama-7b", Layout(), "adam")
    with pytest.raises(PlanError, match="--model 'nope'"):
        make_plan("nope", Layout(), "adamw")
    with pytest.raises(PlanError, match="--gpu-memory '80 parsecs'"):
        parse_bytes("80 parsecs")
    assert parse_bytes("80GiB") == 80 * 2**30


def test_cli_reports_fit_and_gaps(capsys: pytest.CaptureFixture[str], tmp_path: Any, tiny_config: Any) -> None:
    from dist_optim.plan.__main__ import main

    path = tmp_path / "config.json"
    tiny_config.to_json_file(path)
    main(["--model", str(path), "--tp", "2", "--dp", "2", "--zero", "1", "--optimizer", "adamw", "--gpu-memory", "1KB"])
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "not simulated:" in out
    with pytest.raises(SystemExit, match="--optimizer-args"):
        main(["--model", str(path), "--optimizer-args", "[1]"])
    # --cpu-offload: masters, their fp32 gradients, state and the step's transient leave the device
    # for the host; the device keeps the staged buffers of the largest collective
    common = ["--model", str(path), "--plugin", "zero", "--zero", "2", "--dp", "4", "--optimizer", "muon"]
    main([*common, "--no-activations", "--json"])
    plain = json.loads(capsys.readouterr().out)
    main([*common, "--no-activations", "--json", "--cpu-offload"])
    off = json.loads(capsys.readouterr().out)
    b = off["busiest"]
    host = 2 * b["fp32_masters"] + b["optimizer_state"] + b["kept_buffers"] + b["peak_transient"]
    assert off["host_total"] == host > 0 and "host_total" not in plain
    assert off["total"] == plain["total"] - host + b["staged_peak"] and 0 < b["staged_peak"] < b["peak_transient"]
    assert off["host_traffic"]["zero"] == 2 * b["fp32_masters"]
    assert off["host_traffic"]["staging"] == off["steady"]["staged"] > off["steady"]["bytes_sent"]
    main([*common, "--no-activations", "--cpu-offload"])
    assert "of which in host memory (offload)" in capsys.readouterr().out
    # --plugin gemini with GeminiPlugin's chunk search options: its chunks' rows and layout
    chunks = ["--min-chunk-size-m", "0", "--search-range-m", "0", "--hidden-dim", "64"]
    main(["--model", str(path), "--plugin", "gemini", "--dp", "4", *chunks, "--optimizer", "lamb", "--no-activations"])
    out = capsys.readouterr().out
    assert "x Gemini static chunks, chunk search from 0.0 Mi over 0.0 Mi in steps of 64 (4 ranks, bf16)" in out
    assert "Gemini chunks gathered (derived)" in out and "Gemini's chunks: ColossalAI's chunk search" in out


def test_cli_builds_configuration_objects() -> None:
    """Shampoo's grafting_config spelled in JSON as {"<class>": {<arguments>}}; other values as they
    are; an unknown class or bad arguments refused in one line naming the option."""
    from dist_optim.plan.__main__ import _optimizer_args

    args = _optimizer_args('{"grafting_config": {"AdamGraftingConfig": {"beta2": 0.99, "epsilon": 1e-8}}, "lr": 0.1}')
    assert args == {"grafting_config": dist_optim.AdamGraftingConfig(beta2=0.99, epsilon=1e-8), "lr": 0.1}
    assert _optimizer_args('{"betas": {"a": 1}}') == {"betas": {"a": 1}}
    with pytest.raises(PlanError, match="grafting_config.*NopeConfig"):
        _optimizer_args('{"grafting_config": {"NopeConfig": {}}}')
    with pytest.raises(PlanError, match="grafting_config"):
        _optimizer_args('{"grafting_config": {"AdamGraftingConfig": {"beta3": 1}}}')


def test_live_bytes_counts_temporaries_not_inputs() -> None:
    x = torch.ones(1000)
    with LiveBytes() as live:
        y = x * 2  # 4000 bytes, alive after
        z = (y + 1) * 3  # one 4000-byte temporary freed inside
        del z
        x.add_(1)  # in place on an input: nothing new
    assert live.live == 4000 and live.peak == 12000
    del y


def test_meta_items_follow_values_and_forget_unknown_ones() -> None:
    """In a simulation a small meta tensor computed from known values answers ``.item()`` with its
    value (its CPU shadow); one whose value is not known answers the stated guess 0: a fresh
    ``torch.empty`` (no value), and a shadowed one overwritten in place by an op without outputs
    from an unknown tensor (``torch._foreach_copy_``, as GaLore's unpacking of an all-gather; a
    stale shadow there made the plan take the NaN/Inf refusal path)."""
    with LiveBytes(answer_meta_items=True) as live:
        known = torch.zeros(1, device="meta") + 3
        assert known.item() == 3
        assert torch.empty(1, device="meta").item() == 0
        flag = torch.zeros(1, device="meta") + 5
        torch._foreach_copy_([flag], [torch.ones(1000, device="meta")[:1]])
        assert flag.item() == 0
    assert live.meta_items == 2


def test_recipe_dry_run_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from recipes.train import main

    main(["--model", "tiny", "--tp", "2", "--zero", "1", "--world-size", "4", "--optimizer", "lamb", "--dry-run"])
    out = capsys.readouterr().out
    assert "hybrid tp=2 x dp=2 x ZeRO-1 (4 ranks, bf16), optimizer lamb" in out
    assert "optimizer state" in out and "not simulated:" in out
    # the recipe's micro-batch (--batch-size 4, --seq-len 64 by default) and checkpointing switch
    assert "activations of rank 0: 4 x 64 tokens per micro-batch, attention sdpa;" in out
    main(["--model", "tiny", "--tp", "2", "--world-size", "2", "--optimizer", "lamb", "--dry-run", "--grad-checkpoint"])
    assert "4 x 64 tokens per micro-batch, attention sdpa, checkpointed layers" in capsys.readouterr().out
    main(["--model", "tiny", "--sp", "2", "--zero", "1", "--world-size", "4", "--optimizer", "lamb", "--dry-run"])
    assert "hybrid tp=1 x sp=2 x dp=2 x ZeRO-1 (4 ranks, bf16), optimizer lamb" in capsys.readouterr().out


def test_an_unchecked_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation's torch internals are checked per torch release: another release is refused
    with one line naming the version, before anything is simulated."""
    from dist_optim.plan.simulate import as_device

    monkeypatch.setattr(torch, "__version__", "2.4.1")
    with pytest.raises(PlanError, match=r"torch 2\.4\.1 is not one the planner's simulation was checked with"):
        with as_device("cuda"):
            pass
