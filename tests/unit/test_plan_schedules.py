"""The interleaved pipeline schedule as the planner replays it (dist_optim/plan/schedules.py): its
order against ColossalAI's own InterleavedSchedule (its chunk of each forward and backward, its
warm-up count), a replay worked by hand, and bad interleaved layouts and micro-batch counts refused
in one line naming the value and the fix."""

from __future__ import annotations

import types

import pytest

from dist_optim.plan import Layout, PlanError, Workload
from dist_optim.plan.activations import check_microbatches
from dist_optim.plan.models import check_model_layout
from dist_optim.plan.schedules import ChunkBytes, interleaved_order, replay_interleaved
from tests.unit.test_plan_models import TINY


def _colossal_order(stages: int, stage: int, chunks: int, microbatches: int) -> list[tuple[str, int]]:
    """The forwards and backwards of ``stage`` as ColossalAI's InterleavedSchedule numbers them: its
    own get_model_chunk_id, and its warm-up count copied from run_forward_backward."""
    from colossalai.pipeline.schedule.interleaved_pp import InterleavedSchedule

    me = types.SimpleNamespace(
        num_microbatch=microbatches, num_model_chunks=chunks, stage_manager=types.SimpleNamespace(num_stages=stages)
    )

    def chunk(i: int, forward: bool) -> int:
        return int(InterleavedSchedule.get_model_chunk_id(me, i, forward))  # type: ignore[arg-type]

    total = microbatches * chunks
    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    out = [("F", chunk(i, True)) for i in range(warmup)]
    for i in range(total - warmup):
        out += [("F", chunk(i + warmup, True)), ("B", chunk(i, False))]
    out += [("B", chunk(i, False)) for i in range(total - warmup, total)]
    return out


@pytest.mark.parametrize("stages,chunks,microbatches", [(2, 2, 4), (2, 2, 2), (4, 2, 8), (2, 3, 6), (4, 4, 4)])
def test_the_order_is_colossalais(stages: int, chunks: int, microbatches: int) -> None:
    for stage in range(stages):
        order = interleaved_order(stages, stage, chunks, microbatches)
        compute = [(what, c) for what, c in order if what in ("F", "B")]
        assert compute == _colossal_order(stages, stage, chunks, microbatches)
        # every forward but the model's first gets its input received before it, every backward
        # its gradient
        for k, (what, c) in enumerate(order):
            if what in ("F", "B"):
                want = "recv_input" if what == "F" else "recv_grad"
                assert [x for x in order[:k] if x[0] == want][-1][1] == c


def test_a_replay_worked_by_hand() -> None:
    """pp=2, stage 1 (the last), two chunks, two micro-batches, hidden states of 10 bytes: warm-up
    2 x 0 + 1 x 2 = 2 forwards (chunk 0 twice), then F1 B1, F1 B1, then B0 B0."""
    a, b = ChunkBytes(kept=100, forward_peak=120, peak=150), ChunkBytes(kept=200, forward_peak=260, peak=300)
    assert [x for x in interleaved_order(2, 1, 2, 2) if x[0] in "FB"] == [
        ("F", 0), ("F", 0), ("F", 1), ("B", 1), ("F", 1), ("B", 1), ("B", 0), ("B", 0),
    ]  # fmt: skip
    # The largest: each B1, over the two chunk-0 micro-batches kept (200): the first with the next
    # forward's input already received (10), the second with the first B1's input gradient still
    # held (10): 510. The second F1: 200 kept + 10 that held gradient + 10 the first B1's input
    # (its output is the loss) + 260 = 480.
    replay = replay_interleaved(2, 1, [a, b], 2, 10)
    assert replay == type(replay)(peak=510, in_flight=3)


def test_bad_interleaved_layouts_are_one_line() -> None:
    for kwargs, message in (
        (
            dict(pp=2, pp_style="interleaved"),
            "--num-model-chunks 1 with --pp-style interleaved: .* use --num-model-chunks 2",
        ),
        (dict(pp=2, num_model_chunks=2), "--num-model-chunks 2 with --pp-style 1f1b: .* add --pp-style interleaved"),
        (dict(pp=1, pp_style="interleaved", num_model_chunks=2), "--pp-style interleaved with --pp 1: .* --pp 2"),
        (dict(pp=2, pp_style="zbv", num_model_chunks=2), "--pp-style 'zbv': choose one of 1f1b, interleaved"),
    ):
        with pytest.raises(PlanError, match=f"^{message}"):
            Layout("hybrid", **kwargs)  # type: ignore[arg-type]
    config = types.SimpleNamespace(**TINY)  # 2 layers
    with pytest.raises(PlanError, match="^--num-model-chunks 2 with --pp 2: 4 model chunks for the model's 2 layers"):
        check_model_layout(config, pp=2, chunks=2)
    check_model_layout(types.SimpleNamespace(**{**TINY, "num_hidden_layers": 5}), pp=2, chunks=2)  # uneven: spread
    layout = Layout("hybrid", pp=2, pp_style="interleaved", num_model_chunks=2)
    with pytest.raises(PlanError, match="^--batch-size 3 with --pp 2 --pp-style interleaved: .* use --batch-size 4$"):
        check_microbatches(layout, Workload(16, 3))
    check_microbatches(layout, Workload(16, 4))
    assert "pp=2 (interleaved, 2 chunks)" in layout.describe()
