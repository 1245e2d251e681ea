"""The planner's replays of in-place work (``Replays.work``, :func:`dist_optim.kernels.replay.replayable_work`:
Shampoo's owner batches) change no answer and do skip the work: a plan made with the batches replayed
equals, figure for figure, the plan made running every batch, and dispatches fewer operators."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_optim.kernels import replay
from dist_optim.plan import Layout, make_plan, simulate, traffic
from dist_optim.plan import replay as plan_replay
from dist_optim.shampoo import AdamGraftingConfig
from tests.helpers.check import without_seconds

#: Matrices above structured.MIN_SIZE (256); four layers of the same shapes, so that with a small
#: bucket the owner batches of one layer repeat in the next.
CONFIG = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
}
#: A batch per few blocks (the default bucket holds a rank's whole step in one batch here).
SMALL_BUCKET = {"bucket_bytes": 1 << 20, "max_preconditioner_dim": 256}

CASES = {
    "shampoo": ("shampoo", SMALL_BUCKET),
    "kl-shampoo": ("shampoo", {**SMALL_BUCKET, "kl_statistics": True}),
    "shampoo-compact": (
        "shampoo",
        {
            **SMALL_BUCKET,
            "grafting_config": AdamGraftingConfig(beta2=0.999, epsilon=1e-8),
            "use_symmetric_packing": True,
            "optim_bits": 8,
            "preconditioner_bits": 4,
        },
    ),
    "shampoo-warm": ("shampoo", {**SMALL_BUCKET, "root_inverse": "warm"}),
    "soap": ("soap", SMALL_BUCKET),
    "kl-soap": ("soap", {**SMALL_BUCKET, "kl_statistics": True}),
    "kron": ("kron", None),
    "muon": ("muon", None),
}


def _answers(plan: Any) -> Any:
    """The plan's figures, without the times it took."""
    return without_seconds(plan.to_json())


class _Counting(plan_replay.Replays):
    """Replays that add up, over a plan, the works replayed and the operators the recorder saw."""

    work_hits = 0
    work_recorded = 0

    def work(self, fn: Any, describe: Any) -> None:
        hits, recorded = self.work_hits, self.work_recorded
        super().work(fn, describe)
        _Counting.work_hits_total += self.work_hits - hits
        _Counting.work_recorded_total += self.work_recorded - recorded

    work_hits_total = 0
    work_recorded_total = 0


@contextlib.contextmanager
def _dispatches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Count the operators dispatched through the step's recorder (:class:`~dist_optim.plan.traffic.LiveBytes`)."""
    count = [0]
    real = traffic.LiveBytes.__torch_dispatch__

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        count[0] += 1
        return real(self, func, types, args, kwargs)

    with monkeypatch.context() as m:
        m.setattr(traffic.LiveBytes, "__torch_dispatch__", counted)
        yield count


def _plan(path: Path, optimizer: str, args: dict[str, Any] | None) -> Any:
    return _answers(make_plan(str(path), Layout("hybrid", tp=2, dp=2, zero=1), optimizer, args, steps=3))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _without_work_replays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulate, "replaying_work", lambda work: contextlib.nullcontext())  # every batch runs


def test_replayed_batches_skip_their_operators(config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulate, "Replays", _Counting)
    optimizer, args = CASES["shampoo"]
    _plan(config, optimizer, args)  # the single-device ideal, simulated once per process
    _Counting.work_hits_total = _Counting.work_recorded_total = 0
    with _dispatches(monkeypatch) as replayed:
        _plan(config, optimizer, args)
    assert _Counting.work_hits_total > _Counting.work_recorded_total > 0
    _without_work_replays(monkeypatch)
    with _dispatches(monkeypatch) as computed:
        _plan(config, optimizer, args)
    # Every batch replayed is operators not dispatched (a dozen or more each, for this model's batches).
    assert computed[0] - replayed[0] >= 5 * _Counting.work_hits_total


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_batches_give_the_same_plan(config: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    optimizer, args = CASES[case]
    monkeypatch.setattr(simulate, "Replays", _Counting)
    # A process's first plan also holds what the kernels cache for good (the packing's index tables)
    # as buffers kept by its step; the two plans compared come after it.
    _plan(config, optimizer, args)
    _Counting.work_hits_total = 0
    replayed = _plan(config, optimizer, args)
    if optimizer in ("shampoo", "soap"):
        assert _Counting.work_hits_total > 0  # the comparison below compares something
    _without_work_replays(monkeypatch)
    assert _plan(config, optimizer, args) == replayed


def _measure(replays: plan_replay.Replays | None, work: Any) -> list[tuple[int, int, int]]:
    """Live bytes, peak and guesses after each of three calls of ``work`` on the same shapes (new
    tensors each time)."""
    out = []
    hooks = replay.replaying_work(replays.work) if replays is not None else contextlib.nullcontext()
    with hooks, traffic.LiveBytes(answer_meta_items=True) as live:
        if replays is not None:
            replays.live = live
        kept = []
        for _ in range(3):
            x = torch.empty(64, 64, device="meta")
            kept.append(x)
            live.reset_peak()
            replay.replayable_work(functools.partial(work, x, kept), functools.partial(tuple, (x, 2)))
            out.append((live.live, live.peak, live.meta_items))
    return out


def _in_place(x: torch.Tensor, kept: list[torch.Tensor]) -> None:
    scratch = torch.empty(4096, device=x.device)  # freed before the return: transient only
    x.mul_(2).add_(scratch[: x.numel()].view_as(x))
    if bool((x > 0).all()):  # a guessed value
        x.zero_()


def _keeping(x: torch.Tensor, kept: list[torch.Tensor]) -> None:
    kept.append(torch.empty_like(x))  # memory it keeps: never replayed


def test_a_replayed_work_moves_the_recorder_as_the_work_would() -> None:
    replays = plan_replay.Replays()
    assert _measure(replays, _in_place) == _measure(None, _in_place)
    assert (replays.work_hits, replays.work_recorded) == (2, 1)


def test_a_work_that_keeps_memory_runs_every_time() -> None:
    replays = plan_replay.Replays()
    assert _measure(replays, _keeping) == _measure(None, _keeping)
    assert (replays.work_hits, replays.work_recorded) == (0, 0)


def test_a_replayable_work_runs_as_it_is_outside_a_simulation() -> None:
    x = torch.ones(3)
    replay.replayable_work(lambda: x.mul_(2), lambda: pytest.fail("described outside a simulation"))
    assert torch.equal(x, torch.full((3,), 2.0))
