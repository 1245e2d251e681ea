"""The planner's replays (dist_optim/plan/replay.py) change no answer: a plan made with the
replayable functions replayed equals, figure for figure, the plan made running every call."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_optim.kernels import replay
from dist_optim.plan import Layout, make_plan, simulate
from dist_optim.plan import replay as plan_replay
from tests.helpers.check import without_seconds

#: Matrices above structured.MIN_SIZE (256), so that the blocked triangular products recurse.
CONFIG = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 768,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 1024,
    "max_position_embeddings": 256,
}


def _answers(plan: Any) -> Any:
    """The plan's figures, without the times it took."""
    return without_seconds(plan.to_json())


class _Counting(plan_replay.Replays):
    hits_total = 0

    def __call__(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        before = self.hits
        out = super().__call__(fn, args, kwargs)
        _Counting.hits_total += self.hits - before
        return out


@pytest.mark.parametrize("optimizer", ["muon", "kron", "shampoo"])
def test_replayed_plans_equal_computed_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    layout = Layout("hybrid", tp=2, dp=2, zero=1)
    monkeypatch.setattr(simulate, "Replays", _Counting)
    _Counting.hits_total = 0
    replayed = _answers(make_plan(str(path), layout, optimizer, steps=2))
    assert _Counting.hits_total > 0  # the check below compares something

    monkeypatch.setattr(simulate, "replaying", lambda replayer: contextlib.nullcontext())  # every call runs
    assert _answers(make_plan(str(path), layout, optimizer, steps=2)) == replayed


def test_a_replayable_function_runs_as_it_is_outside_a_simulation() -> None:
    calls = []

    @replay.replayable
    def double(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2

    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0)) and calls == [1]


@replay.replayable
def _with_scratch(x: torch.Tensor, scale: float) -> list[torch.Tensor]:
    scratch = torch.empty(4096, device=x.device)  # freed before the return: transient only
    del scratch
    return [x * scale, x.view(-1)]  # one new tensor, one view of the argument


def _measure(replays: plan_replay.Replays | None) -> list[tuple[int, int, bool]]:
    """Live bytes and peak after each of three calls, and whether the view is of the argument."""
    from dist_optim.plan.traffic import LiveBytes

    x = torch.empty(8, 8, device="meta")
    out = []
    with replay.replaying(replays) if replays is not None else contextlib.nullcontext(), LiveBytes() as live:
        if replays is not None:
            replays.live = live
        kept = []
        for _ in range(3):
            live.reset_peak()
            new, view = _with_scratch(x, 2.0)
            kept.append(new)
            same = view.untyped_storage()._cdata == x.untyped_storage()._cdata
            out.append((live.live, live.peak, same and tuple(new.shape) == (8, 8)))
    return out


def test_a_replay_moves_the_recorder_as_the_call_would() -> None:
    replays = plan_replay.Replays()
    assert _measure(replays) == _measure(None)
    assert replays.hits == 2


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_the_recorder_makes_foreach_norms_of_meta_tensors_as_torch_does(dtype: torch.dtype | None) -> None:
    """The recorder makes ``torch._foreach_norm``'s outputs on meta itself (torch's Python
    reference is slow): the same dtypes, shapes and devices as torch's, counted alike."""
    from dist_optim.plan.traffic import LiveBytes

    kinds = [torch.bfloat16, torch.float32, torch.float64, torch.complex64]
    tensors = [torch.empty((3, 4 + i), dtype=d, device="meta") for i, d in enumerate(kinds)]
    if dtype is not None:
        tensors = [t for t in tensors if not t.is_complex() and t.dtype != torch.float64]
    want = torch._foreach_norm(tensors, 2, dtype=dtype)
    with LiveBytes() as live:
        got = torch._foreach_norm(tensors, 2, dtype=dtype)
        assert live.live == sum(t.element_size() for t in want)
    assert [(t.dtype, t.shape, t.device) for t in got] == [(t.dtype, t.shape, t.device) for t in want]


def test_the_recorder_makes_zeros_on_meta_as_torch_does() -> None:
    """And ``torch.zeros`` on meta (torch's reference fills them): the same metadata, counted, and
    a small one's values followed as zeros."""
    from dist_optim.plan.traffic import LiveBytes

    calls: list[dict[str, Any]] = [dict(device="meta"), dict(dtype=torch.bfloat16, device="meta")]
    for kwargs in calls:
        for shape in [(3, 5), (4,), ()]:
            want = torch.zeros(shape, **kwargs)
            with LiveBytes(answer_meta_items=True) as live:
                got = torch.zeros(shape, **kwargs)
                assert live.live == want.untyped_storage().nbytes()
                assert live.shadow_of(got) is not None and not live.shadow_of(got).any()
            assert (got.dtype, got.shape, got.stride(), got.device) == (
                want.dtype,
                want.shape,
                want.stride(),
                want.device,
            )


def test_a_work_is_replayed_only_where_the_values_it_reads_repeat() -> None:
    """An in-place work whose memory depends on a host step counter's value, or on a followed
    meta scalar's, is replayed for the values seen when it was recorded and run for new ones: each
    call's peak is the one running it gives."""
    from dist_optim.plan.traffic import LiveBytes

    def peaks(replays: plan_replay.Replays | None) -> list[int]:
        counter = torch.zeros((), dtype=torch.int64)  # a host step counter
        out = []
        with (
            replay.replaying_work(replays.work) if replays is not None else contextlib.nullcontext(),
            LiveBytes(answer_meta_items=True) as live,
        ):
            if replays is not None:
                replays.live = live
            scale = torch.ones((1, 1), device="meta")  # a followed meta scalar (its shadow is 1)
            state = torch.empty(16, device="meta")

            def work() -> None:
                n = 256 * (1 + int(counter.item()) % 2) * (1 + int(scale.item() > 1))
                torch.empty(n, device="meta")  # scratch, freed: a transient that depends on both
                state.add_(1)

            def describe() -> Any:
                return ("work", state, counter, scale)

            for step in range(6):
                live.reset_peak()
                replay.replayable_work(work, describe)
                out.append(live.peak - live.live)
                counter.fill_((step + 1) % 2)
                if step == 3:
                    scale.mul_(2)  # followed: its shadow becomes 2
        return out

    replays = plan_replay.Replays()
    assert peaks(replays) == peaks(None)
    assert replays.work_hits == 2  # steps 2 and 3: the counter and the scale seen before


def test_the_recorder_answers_in_place_element_wise_operators_with_their_argument() -> None:
    """And an in-place element-wise operator on meta (torch's reference computes the broadcast and
    promotion): its result is its first argument, nothing allocated, a small one's values followed."""
    from dist_optim.plan.traffic import LiveBytes

    with LiveBytes(answer_meta_items=True) as live:
        small = torch.ones(3, device="meta")
        big = torch.empty(64, 32, device="meta")
        row = torch.empty(1, 32, device="meta")
        live.reset_peak()
        assert big.mul_(row).rsqrt_().lerp_(big, 0.1) is big
        assert small.mul_(2.0).clamp_(min=3.0) is small
        assert live.peak == live.live  # nothing made, not even for a moment
        shadow = live.shadow_of(small)
        assert shadow is not None and shadow.tolist() == [3.0, 3.0, 3.0]
