"""Gemini on CPU processes (plugins/cpu.py) and our optimizers under it (plugins/gemini.py), beyond
its column of the README's table (tests/distributed/test_booster.py): the stock plugin's reduced
gradients, fp16 with its loss scale divided out, chunks kept gathered, and the settings refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.test_booster import LOW_PRECISION_SANITY, SPECS, STEPS
from tests.helpers import booster

#: The largest median relative difference, per parameter, between the gradients the boosted
#: optimizer was first handed and one process's at the same weights: the rounding of bf16/fp16
#: reductions (a few units of their last place); a loss scale not divided out is 65535.
GRADIENT_NOISE = 2**-5


# ---- workers (every rank) ----------------------------------------------------------------------
def stock_gradients(precision: str) -> dict[str, Any]:
    """ColossalAI's own GeminiPlugin (no optimizer) on CPU processes: one forward and backward of the
    global batch split over the ranks, the reduced gradient shards gathered from the chunks, against
    one process's gradients of the same batch in the same precision."""
    from colossalai.booster import Booster
    from colossalai.booster.plugin import GeminiPlugin

    from dist_optim import comm
    from dist_optim.plugins.cpu import install, quiet_colossal
    from dist_optim.plugins.gemini import chunk_layout, local_range

    install()
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    with quiet_colossal():
        model, *_ = Booster(plugin=GeminiPlugin(**booster.GEMINI_CHUNKS, precision=precision)).boost(
            booster.tiny_llama()
        )
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        x = booster.rank_batch(0, world, rank)
        model.backward(model(input_ids=x, labels=x).loss)
        pieces, names = [], []
        for name, p in model.module.named_parameters():
            chunk = model.chunk_manager.get_chunk(p)  # the gradient overwrote the chunk (reuse_fp16_chunk)
            begin, end = local_range(chunk, p)
            pieces.append((chunk_layout(chunk, p), chunk.payload[begin:end].float()))
            names.append(name)
        fulls = dict(zip(names, comm.gather_full(pieces)))
    single = booster.tiny_llama().to(low)
    x = booster.global_batch(0)
    single(input_ids=x, labels=x).loss.backward()
    worst = 0.0
    for name, p in single.named_parameters():
        want = p.grad.float().reshape(-1)
        nonzero = want != 0
        rel = ((fulls[name].reshape(-1) - want).abs()[nonzero] / want.abs()[nonzero]).median().item()
        worst = max(worst, rel)
    return {"worst_median_rel": worst, "sharded": sum(chunk_layout(c, p).zero is not None for p, c in _chunks(model))}


def _chunks(model: Any) -> list[tuple[torch.Tensor, Any]]:
    return [(p, model.chunk_manager.get_chunk(p)) for p in model.module.parameters()]


def refusals() -> dict[str, str]:
    """Gemini settings that are refused with our optimizers (and, on CPU processes, the offloading
    placements with any optimizer), each at boost with one line."""
    from colossalai.booster import Booster

    from dist_optim import plugins
    from dist_optim.plugins.cpu import install, quiet_colossal

    install()
    out = {}
    cases = {
        "auto": dict(placement_policy="auto"),
        "offload_optim": dict(offload_optim_frac=0.5),
        "no_masters": dict(master_weights=False),
        "extra_dp": dict(extra_dp_size=2),
        "tp": dict(tp_size=2),
    }
    for label, kwargs in cases.items():
        model = booster.tiny_llama()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if label == "auto" else None
        optimizer = optimizer or booster.make_optimizer("colossalai.nn.optimizer.Lamb", model, dict(lr=1e-3))
        try:
            with quiet_colossal():
                Booster(plugin=plugins.GeminiPlugin(precision="bf16", **kwargs)).boost(model, optimizer)
            out[label] = "no error"
        except ValueError as e:
            out[label] = str(e)
    return out


# ---- tests -------------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_stock_gemini_reduces_gradients_on_cpu(precision, pool4) -> None:
    """The CPU shim runs ColossalAI's own Gemini: forward and backward over 4 ranks, gradients
    reduce-scattered into the chunks' shards, which gathered are one process's gradients up to the
    precision's rounding."""
    for rank, res in enumerate(pool4.run(stock_gradients, precision)):
        assert res["sharded"] > 0, f"rank {rank}: no chunk was sharded"
        assert res["worst_median_rel"] <= GRADIENT_NOISE, (rank, res)


GEMINI_CASES = [
    # fp16: the loss scale (2**16) reaches the optimizer divided out
    pytest.param("Shampoo", "fp16", booster.GEMINI_CHUNKS, id="fp16-Shampoo"),
    # the default chunk search keeps a model this small in one chunk, whole on every rank
    pytest.param("Kron", "bf16", {}, id="kept-gathered-Kron"),
]


@pytest.mark.parametrize("name,precision,chunks", GEMINI_CASES)
def test_gemini_parity(name, precision, chunks, pool4, tmp_path) -> None:
    """The replay of tests/distributed/test_booster.py (the single-device algorithm on what the optimizer
    was handed, parameters and state element-wise) on Gemini settings outside the table's column;
    the gradients handed are the unscaled ones, and the run ends near one process's."""
    spec = SPECS[name]
    kwargs = dict(chunks, placement_policy="static", precision=precision)
    results = pool4.run(booster.booster_parity, "GeminiPlugin", kwargs, *spec.source, STEPS, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["is_dist_optim"] and spec.expected_cls in res["swapped_to"], res["swapped_to"]
        assert res["zero_bound"] == (len(res["errors"]) if chunks else 0), (rank, res["zero_bound"])
        assert res["replayed_steps"] == STEPS and not res["replay"], (rank, res["replay"][:8])
        assert res["grad_noise"] <= GRADIENT_NOISE, (rank, res["grad_noise"])
        bad = {n: e["update_rel"] for n, e in res["errors"].items() if not e["update_rel"] <= LOW_PRECISION_SANITY}
        assert not bad, (rank, bad)


def test_gemini_refusals(pool4) -> None:
    for res in pool4.run(refusals):
        assert "placement_policy='auto'" in res["auto"] and "static" in res["auto"], res
        assert "offload_optim_frac" in res["offload_optim"] and "LowLevelZeroPlugin" in res["offload_optim"], res
        assert "master_weights=True" in res["no_masters"], res
        assert "extra_dp_size=1" in res["extra_dp"], res
        assert "tp_size=1" in res["tp"] and "HybridParallelPlugin" in res["tp"], res
        assert all("\n" not in msg for msg in res.values()), res
