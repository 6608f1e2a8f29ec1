"""Chapter 13's recorded run, on the CPU's 2 gloo ranks and on the one-GPU path (one rank alone,
emulated here with a group of one): every byte count the formulas predict is measured exactly, the
split runs equal their references, and the record follows the results schema."""
import dataclasses

import pytest
import torch

from companion.device import sizes
from companion.record import parallelisms as P
from companion.record.common import SizesRead
from companion.record.runner import CHAPTERS, validate
from companion.results import is_curve

pytestmark = pytest.mark.usefixtures("one_thread")          # tests/conftest.py

SMALL = dataclasses.replace(sizes("cpu"), tp_width=32, tp_heads=4, tp_seq=8, tp_batch=2,
                            cp_len=64, cp_heads=2, cp_head_dim=8, pp_width=32, pp_depth=4,
                            pp_batch=8, pp_micro_batches=4)


def _bytes_agree(measured: dict, predicted: dict) -> list[str]:
    """The names whose measured bytes (numbers, or a curve's y) differ from the predicted ones."""
    y = lambda v: v["y"] if is_curve(v) else v
    return [k for k, want in predicted.items()
            if k.endswith("_bytes") and y(measured[k]) != y(want)]


@pytest.mark.parametrize("world, expected", [(1, 1), (2, 2), (3, 2), (4, 4), (8, 4)])
def test_usable_ranks_are_a_power_of_two_up_to_four(world, expected):
    assert P.usable_ranks(world) == expected


def test_usable_ranks_refuse_no_ranks():
    with pytest.raises(ValueError, match="at least 1"):
        P.usable_ranks(0)


def _record(S) -> dict:
    run = P.parallelisms(SizesRead(S), torch.device("cpu"), repeats=1)
    validate({"machine": "m", "device": "cpu", "torch": "", "cuda": None, "date": "",
              "chapters": {"13": {**run, "date": "", "seconds": 0.0, "sizes": {}}}})
    return run


def test_the_recorded_run_on_two_gloo_ranks():
    assert CHAPTERS["13"] is P.parallelisms
    run = _record(SMALL)
    measured, predicted = run["measured"], run["predicted"]
    assert {k for k in predicted if not k.endswith("_bubble_formula")} <= set(measured)
    assert _bytes_agree(measured, predicted) == []
    for key in ("block_tp2", "block_tp2_sp", "attention_ring2_zigzag", "attention_ulysses2",
                "pipeline_gpipe_p2_m4", "pipeline_1f1b_p2_m4"):
        assert measured[f"{key}_error"] < 1e-4, key
    assert measured["block_tp2_sp_kept_bytes"] < measured["block_tp2_kept_bytes"] \
        < measured["block_whole_kept_bytes"]
    for name in ("gpipe", "1f1b"):
        key = f"pipeline_{name}_p2_m4_stage_peak_activation_bytes"
        assert is_curve(measured[key]) and measured[key]["y"] == predicted[key]["y"]
    assert measured["pipeline_1f1b_p2_m4_first_stage_peak_activation_bytes"] * 2 == \
        measured["pipeline_gpipe_p2_m4_first_stage_peak_activation_bytes"]
    assert measured["attention_full_step_seconds"] > 0
    assert measured["attention_ring2_zigzag_step_seconds"] > 0
    assert (measured["world_size"], measured["ranks_used"], measured["backend"]) == (2, 2, "gloo")
    assert "2 gloo ranks" in measured["ran"]


def test_the_one_gpu_path_records_one_rank_alone(monkeypatch):
    """One GPU (ranks gives 1): no split run, and one rank's memory against the formulas."""
    monkeypatch.setattr(P, "ranks", lambda device: (1, "gloo"))
    run = _record(SMALL)
    measured, predicted = run["measured"], run["predicted"]
    assert not any(k.startswith(("block_", "attention_", "pipeline_")) for k in measured)
    assert _bytes_agree(measured, predicted) == []
    assert measured["tp_shard_kept_bytes_by_t"]["x"] == [1, 2, 4]
    assert measured["tp_shard_kept_bytes_by_t"]["y"] == predicted["tp_shard_kept_bytes_by_t"]["y"]
    assert measured["cp_shard_kept_bytes_by_k"]["y"] == predicted["cp_shard_kept_bytes_by_k"]["y"]
    assert "no split runs" in measured["ran"] and measured["ranks_used"] == 1


def test_a_wrong_prediction_is_seen(monkeypatch):
    """The byte check above fails for a formula at the wrong t: one rank of 2 keeps more than
    one of 4."""
    monkeypatch.setattr(P, "ranks", lambda device: (1, "gloo"))
    run = _record(SMALL)
    measured, predicted = run["measured"], dict(run["predicted"])
    predicted["tp_shard_t2_kept_bytes"] = predicted["tp_shard_t4_kept_bytes"]
    assert _bytes_agree(measured, predicted) == ["tp_shard_t2_kept_bytes"]
