"""The Kolmogorov-Smirnov test the side-channel checks rely on, against the distribution's known values."""

import random

import pytest

from bench.side_channel import kolmogorov_q, ks_2samp


@pytest.mark.parametrize("lam, p", [(1.2238, 0.10), (1.3581, 0.05), (1.6276, 0.01), (1.9495, 0.001)])
def test_the_kolmogorov_tail_gives_the_tabled_critical_values(lam, p):
    assert kolmogorov_q(lam) == pytest.approx(p, rel=0.01)


def test_ks_sees_a_shift_and_not_two_draws_of_one_distribution():
    rng = random.Random(3)
    same = [ks_2samp([rng.gauss(0, 1) for _ in range(300)], [rng.gauss(0, 1) for _ in range(300)])[1]
            for _ in range(200)]
    assert 0.02 <= sum(p < 0.05 for p in same) / len(same) <= 0.09  # p is about uniform: ~5% below 0.05
    d, p = ks_2samp([rng.gauss(0, 1) for _ in range(200)], [rng.gauss(0.5, 1) for _ in range(200)])
    assert p < 0.01 and 0.12 < d < 0.35
    assert ks_2samp([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == (0.0, 1.0)
    assert ks_2samp([1.0, 2.0], [3.0, 4.0])[0] == 1.0
    with pytest.raises(ValueError):
        ks_2samp([], [1.0])
