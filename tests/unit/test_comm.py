"""Collectives: correctness and a constant number per step, whatever the number of params."""

from __future__ import annotations

from tests.helpers import dist_cases


def test_gather_and_bucketed_sums(pool4) -> None:
    small = pool4.run(dist_cases.gather_and_sum, 3)
    large = pool4.run(dist_cases.gather_and_sum, 30)
    # one collective per group (ZeRO group, TP group), independent of the number of params
    assert {r["gathers"] for r in small + large} == {2}
    assert {r["reduces"] for r in small + large} == {2}


def test_share_owned_and_broadcast(pool4) -> None:
    for res in pool4.run(dist_cases.share_and_broadcast):
        assert res["shared"] == 1


def test_lamb_collectives_per_step_are_constant(pool4) -> None:
    few = pool4.run(dist_cases.lamb_collectives, 4)
    many = pool4.run(dist_cases.lamb_collectives, 40)
    # one all-reduce per group (ZeRO, TP) per step, plus the NaN/Inf check's flag over the job
    assert set(few) == set(many) == {3}


def test_grid_groups(pool4) -> None:
    for res in pool4.run(dist_cases.grids):
        assert res["grid"] == [0, 1, 2, 3], res
        assert res["self_pair"] is None and res["world_base"] is None, res
        assert res["same"], res


def test_exchange_moves_uneven_pieces(pool4) -> None:
    for res in pool4.run(dist_cases.exchange_pieces):
        assert res["torch.float32"] and res["torch.bfloat16"] and res["count"] == 1, res
