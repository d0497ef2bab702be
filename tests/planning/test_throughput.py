"""Step time, cost and the Young/Daly checkpoint interval."""

import math

import pytest

from lightning_disttrain.planning import throughput as tp
from lightning_disttrain.planning import young_daly_interval


def test_young_daly_is_sqrt_of_twice_cost_times_mtbf():
    assert young_daly_interval(60, 36_000) == pytest.approx(math.sqrt(2 * 60 * 36_000))  # 2078 s
    f = tp.failures(gpus=1000, nodes=125, checkpoint_seconds=60, device_mtbf_hours=50_000, restart_seconds=600)
    assert f.job_mtbf_hours == pytest.approx(50)
    assert f.interval_seconds == pytest.approx(math.sqrt(2 * 60 * 50 * 3600))
    assert f.overhead == pytest.approx(60 / f.interval_seconds + (f.interval_seconds / 2 + 600) / (50 * 3600))
    spot = tp.failures(1000, 125, 60, 50_000, preemptions_per_node_hour=0.01)
    assert spot.job_mtbf_hours == pytest.approx(1 / (1000 / 50_000 + 125 * 0.01))
    with pytest.raises(ValueError, match="must be > 0"):
        young_daly_interval(0, 10)


def test_step_time_from_flops_and_mfu():
    # 6 GFLOP/token x 1M tokens over 8 GPUs of 1 PFLOP/s at 50%: 1.5 s
    t = tp.throughput(6e9, 1e6, 8, 1e15, 0.5)
    assert t.step_seconds == pytest.approx(1.5) and t.tokens_per_second == pytest.approx(1e6 / 1.5)
    assert tp.throughput(6e9, 1e6, 8, 1e15, 0.5, full_recompute=True).step_seconds == pytest.approx(2.0)
    assert tp.throughput(6e9, 1e6, 8, 1e15, 0.5, pp=4, microbatches=12).step_seconds == pytest.approx(1.5 * 1.25)
    with pytest.raises(ValueError, match=r"mfu=40 must be in \(0, 1\]"):
        tp.throughput(6e9, 1e6, 8, 1e15, 40)


def test_cost_adds_20_percent_and_spot_savings():
    c = tp.cost(token_budget=3.6e9, tokens_per_second=1e6, gpus=8, overhead=0.0, price=2.0, spot_price=1.0,
                spot_overhead=0.5)
    assert c.hours == pytest.approx(1.0)
    assert c.on_demand == pytest.approx(2.0 * 8 * 1.0 * 1.2)
    assert c.spot_hours == pytest.approx(1.5) and c.spot == pytest.approx(1.0 * 8 * 1.5 * 1.2)
    assert c.spot_savings == pytest.approx(19.2 - 14.4)
