"""The wait rule's arithmetic (core/wait_rule.py), on a curve read by hand."""

from slurm_mapa.core.wait_rule import holding_pays, loss_if_started_now
from slurm_mapa.replay.timemodel import TimeModel

CURVE = TimeModel(((10.0, 3.0), (50.0, 1.0)))  # 3x slower at 10 GB/s, none at 50


def test_the_loss_is_the_run_time_times_the_slowdown_gap_scaled_by_the_queue_behind():
    assert loss_if_started_now(100.0, 10.0, 50.0, CURVE, 0, 4, 32) == 200.0
    assert loss_if_started_now(100.0, 30.0, 50.0, CURVE, 0, 4, 32) == 100.0  # 2x at 30 GB/s
    # 8 queued jobs, 4 of 32 GPUs: each waits for an eighth of the extra GPU time -> 1 + 8 * 4/32 = 2x
    assert loss_if_started_now(100.0, 10.0, 50.0, CURVE, 8, 4, 32) == 400.0


def test_no_loss_when_the_gpus_free_now_are_as_good_or_better():
    assert loss_if_started_now(100.0, 50.0, 50.0, CURVE, 10, 4, 32) == 0.0
    assert loss_if_started_now(100.0, 60.0, 40.0, CURVE, 10, 4, 32) == 0.0
    assert loss_if_started_now(100.0, None, 50.0, TimeModel(((10.0, 1.0),)), 3, 4, 32) == 0.0


def test_holding_pays_exactly_while_the_wait_is_shorter():
    assert holding_pays(199.0, 200.0) and not holding_pays(200.0, 200.0) and not holding_pays(float("inf"), 200.0)
