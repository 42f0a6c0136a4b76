"""The dense-vs-MoE contrast of the partition explorer notebook (bidirl.experiments.moe_split, bidirl.viz.moe)."""

from __future__ import annotations

import pytest

from bidirl.experiments.moe_split import COLUMNS, dense_vs_moe, h100_job
from bidirl.job.planner import plan
from bidirl.sim import simulate
from bidirl.viz.moe import dense_moe_figure


@pytest.fixture(scope="module")
def frame():
    return dense_vs_moe(models=("qwen2.5-3b", "qwen3-30b-a3b"), steps=4)


def test_each_row_is_the_planners_envelope_and_the_simulated_gain(frame):
    assert list(frame.columns) == list(COLUMNS)
    assert frame["kind"].tolist() == ["dense", "MoE"]
    for row in frame.itertuples(index=False):
        env = plan(h100_job() | {"model": row.model}).envelope
        assert (row.split, row.trainer_layout, row.trainer_expert_parallel) == (
            env.label, env.trainer_layout, env.trainer_expert_parallel)
        assert row.rollout_gpus + row.trainer_gpus == 32
        with_borrowing = simulate(h100_job() | {"model": row.model}, "bidirl", steps=4, seed=0).summary()
        assert row.throughput_bidirl == with_borrowing["throughput"]
        assert row.gain == pytest.approx(row.throughput_bidirl / row.throughput_no_borrow, rel=1e-12)
        assert 0 <= row.borrows <= row.windows
    moe, dense = frame.iloc[1], frame.iloc[0]
    # same active size, ten times the parameters to hold: the MoE trainer replica is larger
    assert moe["params_active_b"] / dense["params_total_b"] == pytest.approx(3.35 / 3.09, rel=0.02)
    assert moe["trainer_layout"] > dense["trainer_layout"]


def test_a_run_too_short_for_the_window_has_no_gain():
    short = dense_vs_moe(models=("qwen2.5-3b",), steps=2)
    assert short["gain"].isna().all()


def test_the_figure_draws_every_model_in_three_panels(frame):
    fig = dense_moe_figure(frame)
    names = [t.name for t in fig.data]
    assert names[:4] == ["rollout pool", "trainer pool", "rollout pool idle", "trainer pool idle"]
    assert all(len(t.x) == len(frame) for t in fig.data)
    # the trainer pool is stacked on the rollout pool: the split's bars reach the GPU budget
    assert [a + b for a, b in zip(fig.data[1].base, fig.data[1].y)] == [32, 32]
    assert fig.layout.width == 1000
