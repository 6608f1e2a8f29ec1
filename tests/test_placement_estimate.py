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
