"""bench/throughput.py (`python -m bench throughput`): the group-free time to a batch (paper Fig. 5) on hand numbers,
and the simulation reproducing the row docs/benchmarks.md records.

    .venv/bin/python -m pytest tests/test_throughput.py -q
"""
import numpy as np

from bench.throughput import simulate, time_to_batch


def test_spo_waits_for_the_keep_th_trajectory_and_grpo_for_its_groups_slowest_member():
    times = np.array([[5.0, 1.0, 9.0, 3.0, 2.0, 8.0, 4.0, 7.0]])
    assert time_to_batch(times, keep=4, group_size=1).tolist() == [4.0]  # 1, 2, 3, 4
    assert time_to_batch(times, keep=4, group_size=4).tolist() == [8.0]  # groups done at 9 and 8: the faster one


def test_a_group_is_consecutive_trajectories_not_every_g_th():
    times = np.array([[1.0, 9.0, 2.0, 8.0]])  # groups (1, 9) and (2, 8); strided ones would be (1, 2) and (9, 8)
    assert time_to_batch(times, keep=2, group_size=2).tolist() == [8.0]


def test_without_over_sampling_group_free_gains_exactly_nothing():
    ratios = simulate(np.random.default_rng(1), seeds=500, thirds=(3,))  # f = 1: 24 started, 24 kept
    assert all(np.array_equal(row[24], np.ones(500)) for row in ratios.values())


def test_the_simulation_reproduces_the_published_groups_row():
    ratio = simulate(np.random.default_rng(0))[0.375][48]  # docs/benchmarks.md: f = 2, 4.26 [1.48, 4.97]
    assert [round(float(x), 2) for x in (ratio.mean(), *np.percentile(ratio, [2.5, 97.5]))] == [4.26, 1.48, 4.97]
