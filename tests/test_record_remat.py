"""Chapter 12's recorded run and its policy measurements: measured equals predicted where the
chapter says it does, and the run writes what the notebooks can read."""
import dataclasses

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from companion.checkpointing.policy_run import measure_policy
from companion.checkpointing.selective import alternate_matmuls, save_matmuls
from companion.device import sizes
from companion.record import remat
from companion.record.runner import CHAPTERS

pytestmark = pytest.mark.usefixtures("one_thread")          # tests/conftest.py

SMALL = dataclasses.replace(sizes("cpu"), remat_batch=2, seq_len=32, loss_tokens=64,
                            loss_vocab=4096, tiled_tokens=512, offload_depth_long=4)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("make", [lambda: save_matmuls, alternate_matmuls],
                         ids=["save matmuls", "every second matmul"])
def test_a_policys_bytes_and_flops_are_predicted_exactly(kind, make):
    block, x = remat.blocks(SMALL, torch.device("cpu"))[kind]
    x.grad = marker = torch.full_like(x, 7.0)
    run = measure_policy(block, (x,), make)
    assert run.held_bytes == run.predicted_bytes > 0
    assert run.recompute_flops == run.predicted_flops
    assert x.grad is marker                                   # .grad put back as it was


def test_a_policy_that_answers_something_else_is_named():
    block, x = remat.blocks(SMALL, torch.device("cpu"))["gpt"]
    with pytest.raises(TypeError, match="CheckpointPolicy"):
        measure_policy(block, (x,), lambda: (lambda ctx, op, *a, **k: True))
    with pytest.raises(TypeError, match="tuple"):
        measure_policy(block, x, lambda: save_matmuls)


def test_the_policies_table_orders_bytes_and_flops_as_the_chapter_says():
    rows = remat.policy_rows(SMALL, torch.device("cpu"))
    gpt = {name: by_kind["gpt"] for name, by_kind in rows.items()}
    assert gpt["recompute all"].held_bytes < gpt["every second matmul"].held_bytes \
        < gpt["save matmuls"].held_bytes < gpt["keep all"].held_bytes
    assert gpt["keep all"].recompute_flops == 0 < gpt["save matmuls"].recompute_flops \
        < gpt["recompute all"].recompute_flops
    assert rows["keep all outside the core"]["llama"] is None     # SDPA: no written core


def test_the_recorded_run_writes_measured_and_predicted():
    assert CHAPTERS["12"] is remat.activations_budget
    out = remat.activations_budget(SMALL, torch.device("cpu"), repeats=1)
    measured, predicted = out["measured"], out["predicted"]
    for key, value in predicted.items():
        assert measured[key] == value, key                    # bytes, FLOPs, peaks: exact
    assert measured["loss_peak_fused"] < measured["loss_peak_plain"]
    assert measured["tiled_4_held"] == 0 < measured["tiled_1_held"]
    assert measured["compiled_bytes_0"] == 0 < measured["compiled_bytes_1"]
