"""companion.estimate_offload's argument checks: bad settings and budgets raise errors that say
what to pass; budgets may be written as sizes ("80 GB")."""
import pytest

from companion.estimate import choose_offload, offload_placement


@pytest.mark.parametrize("kwargs, message", [
    ({"zero_stage": 3, "zero_init": "no"}, "zero_init must be True or False"),
    ({"zero_stage": 2, "offload_optimizer": "cpu", "convention": "course", "param_bytes": 2.0},
     "param_bytes must be 4"),
    ({"zero_stage": 2, "offload_optimizer": "cpu", "convention": "course", "param_bytes": True},
     "param_bytes must be 4"),
])
def test_offload_placement_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        offload_placement(10**6, **kwargs)


@pytest.mark.parametrize("budget, error", [(float("nan"), ValueError), (float("inf"), ValueError),
                                           ("eighty", ValueError), ([80], TypeError),
                                           (-1, ValueError)])
def test_choose_offload_rejects_bad_budgets(budget, error):
    with pytest.raises(error, match="budget|size"):
        choose_offload(10**9, device_budget=budget, host_budget=10**12)


def test_choose_offload_reads_sizes_like_bytes():
    as_text = choose_offload(7 * 10**9, device_budget="24 GB", host_budget="1 TB",
                             gpus_per_node=8, largest_layer_params=32000 * 4096)
    as_int = choose_offload(7 * 10**9, device_budget=24 * 10**9, host_budget=10**12,
                            gpus_per_node=8, largest_layer_params=32000 * 4096)
    assert as_text == as_int == {"zero_stage": 2, "offload_optimizer": "cpu",
                                 "offload_params": None}


def test_the_ladder_is_not_ordered_by_device_bytes():
    """Why choose_offload tests every rung: ZeRO-3 without offload can need more device memory
    than the rung above it (7B parameters, 8 GPUs: ZeRO-2 + CPU offload 14.00 GB, ZeRO-3 16.27)."""
    P, L = 7 * 10**9, 32000 * 4096
    zero2_cpu = offload_placement(P, zero_stage=2, offload_optimizer="cpu", gpus_per_node=8,
                                  largest_layer_params=L)
    zero3 = offload_placement(P, zero_stage=3, gpus_per_node=8, largest_layer_params=L)
    assert zero2_cpu.device == 2 * P and zero3.device == 4 * L + int(18 * P / 8)
    assert zero3.device > zero2_cpu.device


def test_numpy_integers_count_like_ints():
    """Counts computed with NumPy (a sum of parameter counts) are ints: same placement, plain ints
    out; a NumPy float count is refused like a Python one."""
    numpy = pytest.importorskip("numpy")
    P, L = 7 * 10**9, 32000 * 4096
    cases = [({"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu",
               "gpus_per_node": 8, "largest_layer_params": L, "buffer_factor": 1.5},
              {"gpus_per_node": numpy.int32(8), "largest_layer_params": numpy.int64(L),
               "buffer_factor": numpy.float32(1.5)}),
             ({"zero_stage": 0, "offload_optimizer": "cpu", "convention": "course",
               "param_bytes": 2},
              {"zero_stage": numpy.int64(0), "param_bytes": numpy.int64(2)})]
    for plain_kwargs, numpy_kwargs in cases:
        plain = offload_placement(P, **plain_kwargs)
        numpy_ints = offload_placement(numpy.int64(P), **{**plain_kwargs, **numpy_kwargs})
        assert numpy_ints == plain
        assert all(type(v) is int for v in (numpy_ints.device, numpy_ints.host, numpy_ints.disk))
    with pytest.raises(ValueError, match="n_params must be an int"):
        offload_placement(numpy.float64(P), zero_stage=2)
