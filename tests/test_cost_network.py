"""companion.cost.network: the α–β fit recovers known latency and bandwidth, the predictions follow the
formulas, and the overlap model picks the bucket count a brute-force schedule would."""
import random

import pytest

from companion import launch
from companion.cost import network


def test_fit_recovers_alpha_and_beta_from_synthetic_timings():
    alpha, beta = 50e-6, 1 / 2e9                              # 50 µs, 2 GB/s
    sizes = [2**k for k in range(4, 27, 2)]
    rng = random.Random(0)
    noisy = [(alpha + beta * n) * (1 + rng.uniform(-0.03, 0.03)) for n in sizes]
    a, b = network.fit_alpha_beta(sizes, noisy)
    assert a == pytest.approx(alpha, rel=0.1) and b == pytest.approx(beta, rel=0.05)
    exact = network.fit_alpha_beta(sizes, [alpha + beta * n for n in sizes])
    assert exact == pytest.approx((alpha, beta), rel=1e-9)


@pytest.mark.parametrize("sizes, times", [([1, 1], [1.0, 2.0]), ([1, 2], [1.0]), ([1, 2], [0, 1])])
def test_fit_rejects_what_it_cannot_fit(sizes, times):
    with pytest.raises(ValueError):
        network.fit_alpha_beta(sizes, times)


def test_all_reduce_formulas():
    a, b, S = 1e-5, 1e-9, 8e6
    assert network.all_reduce_seconds(S, 1, alpha=a, beta=b) == 0
    for N in (2, 3, 8):
        ring = network.all_reduce_seconds(S, N, alpha=a, beta=b)
        assert ring == pytest.approx(2 * (N - 1) * a + 2 * (N - 1) / N * S * b)
        naive = network.all_reduce_seconds(S, N, alpha=a, beta=b, algorithm="naive")
        assert naive == pytest.approx(2 * (N - 1) * (a + S * b))
        four = network.all_reduce_seconds(S, N, alpha=a, beta=b, buckets=4)
        assert four - ring == pytest.approx(3 * 2 * (N - 1) * a)    # latency paid 4 times
    with pytest.raises(ValueError, match="ring"):
        network.all_reduce_seconds(S, 2, alpha=a, beta=b, algorithm="tree")


def test_exposed_time_and_best_bucket_count():
    a, b, S, N = 1e-3, 1e-9, 64e6, 2                          # 1 ms latency, 1 GB/s
    one = network.all_reduce_seconds(S, N, alpha=a, beta=b)
    assert network.exposed_seconds(0.05, S, N, alpha=a, beta=b, buckets=1) == pytest.approx(one)
    # backward far shorter than communication: bucket 1 waits 1/8 of it, then all 8 go in a row
    assert network.exposed_seconds(1e-6, S, N, alpha=a, beta=b, buckets=8) == pytest.approx(
        network.all_reduce_seconds(S, N, alpha=a, beta=b, buckets=8) + 1e-6 / 8 - 1e-6, rel=1e-9)
    best = network.best_bucket_count(0.2, S, N, alpha=a, beta=b, most=256)
    brute = min(range(1, 257), key=lambda k: network.exposed_seconds(0.2, S, N, alpha=a, beta=b,
                                                                     buckets=k))
    assert best == brute and 1 < best < 256                  # neither extreme wins
    slow_start = network.best_bucket_count(0.2, S, N, alpha=100 * a, beta=b, most=256)
    assert slow_start < best                                  # more latency: fewer buckets


def test_fit_all_reduce_inverts_the_ring_formula():
    a, b = 40e-6, 2e-10
    sizes = [2**k for k in range(8, 26, 3)]
    for N in (2, 4):
        times = [network.all_reduce_seconds(n, N, alpha=a, beta=b) for n in sizes]
        assert network.fit_all_reduce(sizes, times, N) == pytest.approx((a, b), rel=1e-9)
    with pytest.raises(ValueError, match="world_size >= 2"):
        network.fit_all_reduce(sizes, times, 1)


@pytest.mark.parametrize("impl", ["gloo", "ring", "naive"])
def test_all_reduce_timings_grow_with_size(impl):
    sizes = [64, 2**24]
    times = launch.run(network.time_all_reduce_sizes, 2, impl, sizes, 3, timeout=60)
    assert times[0] == times[1]                                # the slowest rank's, on every rank
    assert times[0][0] > 0 and times[0][1] > 16 * 2**20 / 100e9   # 16 MiB: not faster than 100 GB/s


def test_buckets_are_the_ones_ddp_makes():
    import torch
    from torch import nn

    from companion.ddp.core import _make_buckets

    sizes = [300, 5, 1000, 7, 250, 250, 2000, 1]
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    for cap in (4, 1000, 1200, 4000, 10**6):
        ours = network.buckets([4 * n for n in sizes], cap)
        theirs = _make_buckets(params, cap)
        assert [size for _, size in ours] == [4 * b.flat.numel() for b in theirs]
        ends = [sum(len(b.params) for b in theirs[:j + 1]) - 1 for j in range(len(theirs))]
        assert [last for last, _ in ours] == ends
    with pytest.raises(ValueError, match="cap_bytes"):
        network.buckets(sizes, 0)


def test_bucketed_exposure_matches_the_equal_bucket_model():
    a, b, N, S, T = 1e-4, 1e-9, 4, 64e6, 0.05
    for count in (1, 2, 8, 32):
        got = network.bucketed_exposed([S / 32] * 32, [T / 32] * 32, N, alpha=a, beta=b,
                                       cap_bytes=S / count)
        assert got == pytest.approx(network.exposed_seconds(T, S, N, alpha=a, beta=b,
                                                            buckets=count), rel=1e-9)
    one_big_last = network.bucketed_exposed([1e6] * 7 + [50e6], [0.5 / 8] * 8, N, alpha=a,
                                            beta=b, cap_bytes=8e6)
    assert one_big_last == pytest.approx(network.all_reduce_seconds(50e6, N, alpha=a, beta=b))
    with pytest.raises(ValueError, match="one backward time"):
        network.bucketed_exposed([1.0], [], 2, alpha=a, beta=b, cap_bytes=1.0)


def test_residuals_are_relative_errors_of_the_fit():
    a, b = 1e-4, 1e-9
    sizes = [1e3, 1e6, 1e8]
    exact = [network.all_reduce_seconds(n, 2, alpha=a, beta=b) for n in sizes]
    assert network.residuals(sizes, exact, alpha=a, beta=b, world_size=2) == \
        pytest.approx([0, 0, 0], abs=1e-12)
    slow = [t * 1.5 for t in exact]
    assert network.residuals(sizes, slow, alpha=a, beta=b, world_size=2) == \
        pytest.approx([0.5] * 3)
    assert network.residuals([10.0], [2.0], alpha=1.0, beta=0.1) == pytest.approx([0.0])
