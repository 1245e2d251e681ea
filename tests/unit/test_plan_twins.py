"""The planner's twin simulations. Twin stages (:func:`dist_optim.plan.simulate.stage_twin_key`): a
rank of a pipeline stage that holds what an earlier stage holds, at the same place in its stage's
grid, is answered with that stage's simulation. Twin ZeRO stages
(:func:`dist_optim.plan.simulate.sharing_zero_stages`, a sweep's): a ZeRO-2 layout's ranks are
answered with its ZeRO-1 layout's. A plan made so equals, figure for figure, the plan that
simulates every rank, and simulates fewer ranks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dist_optim import plan as planner
from dist_optim.plan import Layout, activations, make_plan, simulate
from dist_optim.plan.activations import Workload
from dist_optim.plan.models import load_config
from tests.helpers.check import without_seconds

#: Eight layers over four stages: the two middle stages hold two layers each, the first also the
#: embedding and the last the norm and the head.
CONFIG = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 384,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}
#: Every rank of a world of 8 simulated (two data-parallel ranks per stage), and a world of 16 with
#: rank 0, the busiest owner and the stages' first ranks.
LAYOUTS = {
    "pp4-dp2-zero1": (Layout("hybrid", pp=4, dp=2, zero=1, precision="bf16"), 8),
    "tp2-pp4-dp2-zero1": (Layout("hybrid", tp=2, pp=4, dp=2, zero=1, precision="bf16"), 1),
}
#: The optimizers with the most varied collectives: norms, owners' routes in buckets.
OPTIMIZERS = {
    "lamb": None,
    "shampoo": {"bucket_bytes": 1 << 18, "max_preconditioner_dim": 128},
    "muon": {"bucket_bytes": 1 << 18},
    "kron": None,
}


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("twins") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _plan(config: Path, layout_id: str, optimizer: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, int]:
    """The plan's figures and the number of ranks it simulated."""
    layout, all_up_to = LAYOUTS[layout_id]
    with monkeypatch.context() as m:
        calls = _counted(m, planner, "simulate_rank")
        made = make_plan(str(config), layout, optimizer, OPTIMIZERS[optimizer], steps=3, all_ranks_up_to=all_up_to)
    return without_seconds(made.to_json()), calls[0]


def _counted(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Count the calls of ``module.name`` (patched for the test): ``[calls]``."""
    calls = [0]
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("layout_id", list(LAYOUTS))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_twin_stages_give_the_plan_of_every_rank(
    config: Path, layout_id: str, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    twinned, fewer = _plan(config, layout_id, optimizer, monkeypatch)
    monkeypatch.setattr(planner, "stage_twin_key", lambda *args: None)  # every rank simulated
    every, all_ranks = _plan(config, layout_id, optimizer, monkeypatch)
    assert twinned == every
    # the second middle stage's ranks are the first's: 2 of 8 ranks, or 1 of the 16-rank plan's 5
    assert all_ranks - fewer == (2 if layout_id == "pp4-dp2-zero1" else 1), (all_ranks, fewer)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_zero2_answered_by_zero1_gives_its_own_plan(
    config: Path, optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside :func:`~dist_optim.plan.simulate.sharing_zero_stages`, the ZeRO-2 plan after the ZeRO-1
    plan simulates nothing and equals the ZeRO-2 plan simulated on its own; ZeRO-0 (other shards)
    is simulated."""
    layouts = {z: Layout("hybrid", tp=2, dp=2, zero=z, precision="bf16") for z in (0, 1, 2)}
    args = OPTIMIZERS[optimizer]

    def plan(zero: int) -> Any:
        return without_seconds(make_plan(str(config), layouts[zero], optimizer, args, steps=3).to_json())

    alone = plan(2)
    calls = _counted(monkeypatch, simulate, "_simulate_rank")  # simulations really run
    with simulate.sharing_zero_stages():
        plan(1)
        first = calls[0]
        shared = plan(2)
        assert calls[0] == first, "the ZeRO-2 plan simulated ranks the ZeRO-1 plan had simulated"
        plan(0)
        assert calls[0] == 2 * first, "the ZeRO-0 plan was answered from a ZeRO plan"
    assert shared == alone
    assert shared != without_seconds(make_plan(str(config), layouts[1], optimizer, args, steps=3).to_json())


#: Two stages' worth of 1F1B and of the interleaved schedule (two chunks per stage): stages 1 and 2
#: hold alike (layers 2-3 and 4-5; interleaved: 1 and 5, 2 and 6).
ACTIVATION_LAYOUTS = {
    "tp2-pp4-1f1b": Layout("hybrid", tp=2, pp=4, dp=1, precision="bf16"),
    "pp4-interleaved": Layout(
        "hybrid", pp=4, dp=2, zero=1, precision="bf16", pp_style="interleaved", num_model_chunks=2
    ),
}


@pytest.mark.parametrize("layout_id", list(ACTIVATION_LAYOUTS))
def test_twin_stages_and_one_split_give_each_stage_its_activations(
    config: Path, layout_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each stage's activations with and without checkpointing, simulated on one split model per
    stage and the second middle stage answered by the first, equal those simulated stage by stage,
    each workload on a model of its own; the second middle stage is not simulated."""
    layout = ACTIVATION_LAYOUTS[layout_id]
    cfg = load_config(str(config))
    works = [Workload(32, 4, True, "sdpa"), Workload(32, 4, False, "sdpa")]  # checkpointing then not
    calls = _counted(monkeypatch, activations, "rank_activations")
    shared = activations.stage_activations_each(cfg, layout, works, "cpu")
    assert calls[0] == 3, "stage 2 was simulated, or the workloads not on one split model"
    fresh = [
        {s: activations.activations_of_rank(cfg, layout, w, layout.stage_ranks(s)[0], "cpu") for s in range(4)}
        for w in works
    ]
    assert [{s: _figures(a) for s, a in by_stage.items()} for by_stage in shared] == [
        {s: _figures(a) for s, a in by_stage.items()} for by_stage in fresh
    ]
    assert shared[0][1].in_flight != shared[0][2].in_flight  # each stage's own place in the schedule


def _figures(acts: activations.Activations) -> Any:
    return without_seconds(dataclasses.asdict(acts))
