"""booster.save_optimizer / load_optimizer for our optimizers: exact resume on the same layout,
resume after resharding to another layout/plugin, layout-independent files, clear errors."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from dist_optim.plugins.checkpoint import read_checkpoint
from tests.helpers import booster, ckpt
from tests.helpers.cases import FAMILIES
from tests.helpers.check import differences

#: What a user passes to ``booster.boost`` per optimizer (tests/helpers/cases.py ``FAMILIES``), by test id.
OPTIMIZERS = {f.name.lower(): f.checkpoint for f in FAMILIES}

HP_TP2 = ("HybridParallelPlugin", dict(tp_size=2, pp_size=1, zero_stage=0, precision="fp32"))
LLZ_FP32 = ("LowLevelZeroPlugin", dict(stage=2, precision="fp32", overlap_communication=False))
DDP = ("TorchDDPPlugin", dict())
HP_TP2_ZERO2 = (
    "HybridParallelPlugin",
    dict(tp_size=2, pp_size=1, zero_stage=2, precision="bf16", overlap_communication=False),
)
LLZ_BF16 = ("LowLevelZeroPlugin", dict(stage=1, precision="bf16", overlap_communication=False))
# ZeRO's CPU offload: masters and optimizer state in host memory.
LLZ_OFFLOAD = ("LowLevelZeroPlugin", dict(LLZ_FP32[1], cpu_offload=True))
HP_TP2_ZERO1_OFFLOAD = (
    "HybridParallelPlugin",
    dict(tp_size=2, pp_size=1, zero_stage=1, precision="bf16", overlap_communication=False, cpu_offload=True),
)
# A tiny Mixtral: 4 experts over ep=2 (expert state on the MoE data-parallel group), and ep=1.
MOE_EP2 = (
    "MoeHybridParallelPlugin",
    dict(tp_size=1, pp_size=1, ep_size=2, zero_stage=1, precision="bf16", overlap_communication=False),
)
MOE_EP1 = ("MoeHybridParallelPlugin", dict(MOE_EP2[1], ep_size=1))
# FSDP's full shard over 4 ranks: each rank holds unpadded ranges of the parameters, most empty.
FSDP = ("TorchFSDPPlugin", dict())
# Gemini's static placement over 4 ranks: flat ranges of several chunks' shards, bf16 with fp32 masters.
GEMINI = ("GeminiPlugin", dict(booster.GEMINI_CHUNKS, placement_policy="static", precision="bf16"))


SAME_LAYOUT = [
    pytest.param(HP_TP2, False, id="tp2-fp32-file"),
    pytest.param(HP_TP2, True, id="tp2-fp32-sharded"),
    pytest.param(HP_TP2_ZERO2, True, id="tp2-zero2-bf16-sharded"),
    pytest.param(MOE_EP2, True, id="moe-ep2-bf16-sharded"),
    pytest.param(LLZ_OFFLOAD, True, id="llz-offload-fp32-sharded"),
    pytest.param(FSDP, True, id="fsdp-fp32-sharded"),
]
RESAVED = [
    pytest.param(HP_TP2_ZERO2, LLZ_BF16, id="tp2-to-llz"),
    pytest.param(MOE_EP2, MOE_EP1, id="moe-ep2-to-ep1"),
    pytest.param(HP_TP2_ZERO1_OFFLOAD, LLZ_BF16, id="tp2-offload-to-llz"),
    pytest.param(FSDP, LLZ_BF16, id="fsdp-to-llz"),
]


#: Steps before a save and after the load. Shampoo's rows refresh their roots and bases at every
#: second step (precondition_frequency=2): those of step 2 are saved and used as saved at step 3,
#: then refreshed from the loaded factors at step 4; Kron updates its factors at both. After an odd
#: number of steps the next step refreshes, so the saved roots would never be used (a perturbed root
#: then passes). The state compared after them is bit for bit or not: more steps only lengthen the suite.
BEFORE, AFTER = 2, 2

#: The uninterrupted runs by (layout, optimizer): a layout's file and sharded checkpoints resume
#: into the same run, run once.
_STRAIGHT: dict[tuple[str, str], list[Any]] = {}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("layout,shard", SAME_LAYOUT)
def test_exact_resume_same_layout(name, layout, shard, pool4, tmp_path) -> None:
    """BEFORE steps + save + load + AFTER steps == the uninterrupted run, bit for bit, on every rank: the
    full fp32 master weights and working weights of the rank's parameters (under expert
    parallelism each rank's own experts), the full optimizer state (owner-held factors, roots,
    projectors included) and the optimizer-level state (generators, counters). Under bf16 ZeRO the
    fp32 masters exist only in the optimizer (the model file holds bf16 weights): the checkpoint
    carries them, else the resumed run would continue from bf16-rounded masters."""
    opt = OPTIMIZERS[name]
    path = str(tmp_path)
    pool4.run(ckpt.train_and_save, *layout, *opt, BEFORE, path, shard)
    resumed = pool4.run(ckpt.load_and_train, *layout, *opt, BEFORE, AFTER, path, shard, with_state=True)
    key = (repr(layout), name)
    if key not in _STRAIGHT:
        _STRAIGHT[key] = pool4.run(ckpt.uninterrupted, *layout, *opt, BEFORE + AFTER, with_state=True)
    straight = _STRAIGHT[key]
    for rank, (got, expected) in enumerate(zip(resumed, straight)):
        assert got["weights"] and got["state"], f"rank {rank} compared nothing"
        bad = differences(got, expected)
        assert not bad, f"rank {rank}: not identical after resume: {bad[:10]}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_resume_after_resharding(name, pool4, pool2, tmp_path) -> None:
    """Saved at tp=2 x dp=2, resumed with ZeRO-2 on 4 ranks, with FSDP on 4 ranks and with DDP on 2
    ranks for AFTER steps.
    On every rank: the loaded state is the saved one (bit for bit what tp=2 x dp=2 held),
    and the steps after it are the single-device algorithm's from that state on what the new
    layout handed the optimizer (tests/helpers/booster.py ``replay``): weights and full optimizer state
    element-wise within 1e-5 (tests/helpers/check.py). That the file itself does not depend on the layout
    is test_files_do_not_depend_on_layout's."""
    opt_path, opt_kwargs = OPTIMIZERS[name]
    path = str(tmp_path)
    saved = pool4.run(ckpt.train_and_save, *HP_TP2, opt_path, opt_kwargs, BEFORE, path, True, with_state=True)[0]
    for pool, target in ((pool4, LLZ_FP32), (pool4, FSDP), (pool2, DDP)):
        results = pool.run(ckpt.load_and_train, *target, opt_path, opt_kwargs, BEFORE, AFTER, path, True, record=True)
        for rank, res in enumerate(results):
            assert len(res["records"]) == AFTER, (target[0], rank, len(res["records"]))
            # the state the new layout loaded is the state the old layout saved
            bad = differences(res["loaded"]["state"], saved["state"])
            assert not bad, (target[0], rank, "loaded state differs from the saved one", bad[:8])
            ref, ref_states = booster.replay(opt_path, opt_kwargs, res["records"], start=res["loaded"])
            bad = booster.replay_mismatches(res["weights"], res["state"], ref, ref_states, booster.REPLAY_RTOL)
            assert not bad, (target[0], rank, bad[:8])


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("saved,loaded", RESAVED)
def test_files_do_not_depend_on_layout(name, saved, loaded, pool4, tmp_path) -> None:
    """State saved at tp=2 x ZeRO-2 (bf16) and re-saved after loading with ZeRO-1 on 4 ranks is
    identical: the format holds full tensors keyed by parameter name. The same from expert
    parallelism (experts split over 2 rank pairs, each writing its experts) to none."""
    opt = OPTIMIZERS[name]
    path = str(tmp_path)
    pool4.run(ckpt.train_and_save, *saved, *opt, BEFORE, path, True)
    resave = os.path.join(path, "resaved.pt")
    pool4.run(ckpt.load_and_train, *loaded, *opt, BEFORE, 0, path, True, resave)
    a, b = read_checkpoint(os.path.join(path, "optim")), read_checkpoint(resave)
    assert set(a["state"]) == set(b["state"]) and a["state"]
    for pname, state in a["state"].items():
        assert set(state) == set(b["state"][pname])
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b["state"][pname][key]), (pname, key)
            else:
                assert value == b["state"][pname][key], (pname, key)


def _resume_and_resave(pool4: Any, layout: tuple, opt: tuple, path: str) -> tuple[dict, dict]:
    """BEFORE steps + save + load + AFTER steps under ``layout`` equal to the uninterrupted run, bit for
    bit on every rank; then the saved state loaded with ZeRO-1 on 4 ranks and saved again. Returns the
    two files' contents (saved, re-saved)."""
    pool4.run(ckpt.train_and_save, *layout, *opt, BEFORE, path, True)
    resumed = pool4.run(ckpt.load_and_train, *layout, *opt, BEFORE, AFTER, path, True, with_state=True)
    straight = pool4.run(ckpt.uninterrupted, *layout, *opt, BEFORE + AFTER, with_state=True)
    for rank, (got, expected) in enumerate(zip(resumed, straight)):
        assert got["weights"] and got["state"] and got["working"], f"rank {rank} compared nothing"
        bad = differences(got, expected)
        assert not bad, f"rank {rank}: not identical after resume: {bad[:10]}"
    resave = os.path.join(path, "resaved.pt")
    pool4.run(ckpt.load_and_train, *LLZ_BF16, *opt, BEFORE, 0, path, True, resave)
    return read_checkpoint(os.path.join(path, "optim")), read_checkpoint(resave)


@pytest.mark.parametrize("name", ["lamb", "shampoo"])
def test_gemini_exact_resume_and_reshard(name, pool4, tmp_path) -> None:
    """Under Gemini, as test_exact_resume_same_layout (sharded files): BEFORE steps + save + load +
    AFTER steps == the uninterrupted run, bit for bit, masters (which only the optimizer holds),
    working weights, full state and optimizer-level state; and the state Gemini saved, loaded with
    ZeRO-1 on 4 ranks and saved again, is the same file content. Not a column of the README's table
    (two rows, not all): Gemini's column there is its booster parity."""
    a, b = _resume_and_resave(pool4, GEMINI, OPTIMIZERS[name], str(tmp_path))
    assert set(a["state"]) == set(b["state"]) and a["state"] and a["masters"]
    for pname, state in a["state"].items():
        for key, value in state.items():
            same = (
                torch.equal(value, b["state"][pname][key])
                if isinstance(value, torch.Tensor)
                else value == b["state"][pname][key]
            )
            assert same, (pname, key)
    for pname, master in a["masters"].items():
        assert torch.equal(master, b["masters"][pname]), pname


#: heavyball's SOAP and PSGDKron as a user builds them, swapped at boost for DistributedShampoo
#: (soap_step="heavyball": a seeding first step and steps counted by the optimizer, saved with it) and
#: DistributedKron (variant="heavyball": the update schedule's running sum and owner-held lower bounds).
HEAVYBALL = {
    "heavyball-soap": ("tests.helpers.booster.heavyball_soap", dict(lr=2e-3, precondition_frequency=2)),
    "heavyball-psgd-kron": ("tests.helpers.booster.heavyball_psgd_kron", dict(lr=1e-3)),
}


@pytest.mark.parametrize("name", sorted(HEAVYBALL))
def test_heavyball_conversions_resume_exactly_and_reshard(name, pool4, tmp_path) -> None:
    """heavyball's optimizers through the booster's checkpoints at tp=2 x ZeRO-2 (bf16): BEFORE steps +
    save + load + AFTER steps == the uninterrupted run, bit for bit; the state loaded with ZeRO-1 on 4
    ranks and saved again is the same file content."""
    pytest.importorskip("heavyball")
    a, b = _resume_and_resave(pool4, HP_TP2_ZERO2, HEAVYBALL[name], str(tmp_path))
    assert set(a["state"]) == set(b["state"]) and a["state"]
    for pname, state in a["state"].items():
        assert set(state) == set(b["state"][pname]), pname
        for key, value in state.items():
            same = (
                torch.equal(value, b["state"][pname][key])
                if isinstance(value, torch.Tensor)
                else value == b["state"][pname][key]
            )
            assert same, (pname, key)


# The tests behind the README's "checkpoint" column (tests/helpers/support.py): each runs once per entry of
# OPTIMIZERS, on each of these layouts (pytest ids "<layout>-<name>", or "<name>" without layouts).
TABLE_TESTS = {
    "test_exact_resume_same_layout": SAME_LAYOUT,
    "test_resume_after_resharding": [],
    "test_files_do_not_depend_on_layout": RESAVED,
}


def test_bad_checkpoints_are_refused(pool4, tmp_path) -> None:
    path = str(tmp_path)
    with open(os.path.join(path, "corrupted.pt"), "wb") as f:
        f.write(b"this is not a checkpoint")
    torch.save({"state": {}, "param_groups": []}, os.path.join(path, "foreign.pt"))  # a plain torch state dict
    os.makedirs(os.path.join(path, "not_a_checkpoint"))
    for res in pool4.run(ckpt.bad_loads, *HP_TP2, *OPTIMIZERS["lamb"], path):
        assert "cannot read optimizer checkpoint" in res["corrupted"], res
        assert "not a dist_optim optimizer checkpoint" in res["foreign"], res
        assert "not a dist_optim optimizer checkpoint" in res["folder"], res


def test_checkpoint_of_another_optimizer_is_refused(pool4, tmp_path) -> None:
    path = str(tmp_path)
    pool4.run(ckpt.train_and_save, *HP_TP2, *OPTIMIZERS["lamb"], 1, path, False)
    with pytest.raises(AssertionError, match="cannot be loaded into DistributedAdafactor"):
        pool4.run(ckpt.load_and_train, *HP_TP2, *OPTIMIZERS["adafactor"], 1, 1, path, False)


#: Shampoo with its compact states: packed factors and roots, 8-bit moments, grafting state
#: and momentum (every tensor of the tiny Llama at min_8bit_size=0); and with 4-bit eigenvectors in
#: place of the roots (preconditioner_bits=4). Not rows of the README's table.
_PACKED_8BIT = dict(OPTIMIZERS["shampoo"][1], use_symmetric_packing=True, optim_bits=8, min_8bit_size=0)
COMPACT = {
    "shampoo-packed-8bit": ("dist_optim.DistributedShampoo", _PACKED_8BIT),
    "shampoo-packed-8bit-pb4": ("dist_optim.DistributedShampoo", dict(_PACKED_8BIT, preconditioner_bits=4)),
}


@pytest.mark.parametrize("name", sorted(COMPACT))
def test_compact_states_resume_exactly_and_files_do_not_depend_on_layout(name, pool4, tmp_path) -> None:
    """The compact states through the booster's checkpoints: BEFORE steps + save + load + AFTER steps == the
    uninterrupted steps bit for bit at tp=2 x ZeRO-2 (bf16, sharded files: packed triangles and
    8-bit codes gathered from their owners and holders, absmax included); and the state saved
    there, loaded with ZeRO-1 on 4 ranks and saved again, is the same file content."""
    a, b = _resume_and_resave(pool4, HP_TP2_ZERO2, COMPACT[name], str(tmp_path))
    kinds = {
        value.dtype for state in a["state"].values() for value in state.values() if isinstance(value, torch.Tensor)
    }
    assert torch.uint8 in kinds, "no 8-bit codes in the file"
    for pname, state in a["state"].items():
        assert set(state) == set(b["state"][pname])
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b["state"][pname][key]), (pname, key)
