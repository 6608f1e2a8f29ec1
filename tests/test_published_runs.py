"""The corpus of published runs (companion/plan/published_runs.json) and its bench.

The corpus's schema and split; the bench's functions on a few runs. No assertion on the errors:
those are the planner's to meet (issue 52), the bench reports them."""
import dataclasses
import importlib.util
import json
import pathlib
import re
import sys

import pytest

from companion.cost import gpus
from companion.plan import GPTShape, load_config, predict_memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_published",
                                               ROOT / "benchmarks" / "bench_published.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_published"] = bench            # dataclasses look their module up
_spec.loader.exec_module(bench)

RUNS = bench.load_runs()
BY_ID = {r["id"]: r for r in RUNS}


def test_the_corpus_has_enough_runs_from_enough_sources_and_a_fixed_split():
    assert len(RUNS) >= 12 and len(BY_ID) == len(RUNS)          # ids unique
    assert len({r["source"]["repository"] for r in RUNS}) >= 4
    assert {r["split"] for r in RUNS} == set(bench.SPLITS)
    assert 2 * sum(r["split"] == "fit" for r in RUNS) <= len(RUNS)
    usable = [r for r in RUNS if r.get("usable", True)]
    assert len(usable) >= 12
    assert len({r["source"]["repository"] for r in usable}) >= 4
    outcomes = [r["measured"]["outcome"] for r in usable]
    assert "out of memory" in outcomes and "ran" in outcomes


@pytest.mark.parametrize("run", RUNS, ids=lambda r: r["id"])
def test_every_run_quotes_its_source_and_its_figures(run):
    source = run["source"]
    assert source["url"].startswith("https://") and source["repository"].count("/") == 1
    assert source["path"] and run["quote"].strip() and run["setup_quote"].strip()
    m = run["measured"]
    figures = [m[k] for k in ("peak_gib", "peak_gb", "tokens_per_s_per_gpu") if k in m]
    assert figures or m["outcome"] == "out of memory" or m["outcome"] == "ran"
    for value in figures:                 # each figure as the quoted line prints it
        assert any(text in run["quote"] for text in (str(value), f"{value:,}", f"{value:.2f}"))
    if m["outcome"] == "out of memory":
        assert "OOM" in run["quote"] or "out of memory" in run["quote"].lower()
    if run.get("usable", True):
        load_config(run["model"])         # a config the planner can load
        gpus.gpu(run["planner_gpu"])      # a card of companion.cost.gpus
    else:
        assert run["unusable_why"]


def test_load_runs_rejects_a_bad_corpus(tmp_path):
    run = dict(BY_ID["litgpt-llama2-7b-lora-1xa10g"])
    for change, message in [({"split": "train"}, "split must be one of"),
                            ({"levers": ["pure-bf16", "tensor-parallel"]}, "unknown lever"),
                            ({"global_batch": 9}, "global_batch is not"),
                            ({"measured": {"outcome": "ran", "peak_gb": 1.0}}, "peak_kind")]:
        path = tmp_path / "runs.json"
        path.write_text(json.dumps({"runs": [{**run, **change}]}))
        with pytest.raises(ValueError, match=message):
            bench.load_runs(path)
    path.write_text(json.dumps({"runs": [{k: v for k, v in run.items() if k != "source"}]}))
    with pytest.raises(ValueError, match="has no 'source'"):
        bench.load_runs(path)


def test_a_lora_run_is_predicted_with_its_own_levers():
    run = BY_ID["litgpt-llama2-7b-lora-1xa10g"]
    case = bench.predict_run(run)
    c = case.candidate
    assert (c.micro_batch, c.accumulation, c.lora_rank, c.zero_stage) == (2, 4, 32, 0)
    assert case.measured_peak == round(19.77e9)
    shape = GPTShape.of(load_config("llama-2-7b").model_fn(512))
    tensors = predict_memory(shape, c, device_type="cuda").peak
    # "allocated" is compared with the tensors and the allocator's workspaces, not the total
    assert tensors < case.predicted_peak < case.gpu_total
    assert case.budget == gpus.gpu("A10").usable_bytes and case.predicted_tps > 0
    assert case.peak_error == pytest.approx(case.predicted_peak / case.measured_peak - 1)


def test_each_counter_is_compared_with_its_own_prediction():
    run = BY_ID["litgpt-llama2-7b-lora-1xa10g"]
    got = {}
    for kind in bench.KINDS:
        changed = {**run, "measured": {**run["measured"], "peak_kind": kind}}
        got[kind] = bench.predict_run(changed).predicted_peak
    assert got["allocated"] < got["reserved"] < got["nvidia-smi"]
    assert got["nvidia-smi"] == bench.predict_run(run).gpu_total


def test_out_of_memory_runs_are_judged_against_the_quoted_capacity():
    case = bench.predict_run(BY_ID["hf-fsdp-gpt2xl-ddp-1gpu-oom"])
    assert case.budget == round(23.65 * 2**30) and case.fits is not None
    assert case.candidate.describe() == "plain (no technique)"
    assert any(line.startswith("  hf-fsdp-gpt2xl-ddp-1gpu-oom: ")
               for line in bench.oom_report([case]))


def test_levers_the_planner_lacks_are_reported_not_crashed(monkeypatch):
    monkeypatch.setitem(bench.LEVERS, "made-up", {"no_such_field": True})
    run = {**BY_ID["litgpt-llama2-7b-lora-1xa10g"], "levers": ["made-up"]}
    case = bench.predict_run(run)
    assert case.candidate is None and case.status == "not expressible yet: made-up"
    case = bench.predict_run(BY_ID["torchtitan-8b-8xh100-float8"])
    assert case.candidate is None and case.status.startswith("unusable: Float8")


def test_pure_bf16_under_adapters_is_predicted_as_bf16_with_a_master():
    # the planner plans pure bf16 without adapters only: with LoRA the run is predicted as bf16
    # weights with fp32 masters (the same frozen bf16 base), marked "~"
    run = BY_ID["litgpt-llama2-7b-lora-1xa10g"]
    case = bench.predict_run(run)
    assert case.status == "~" and case.candidate.precision == "mixed"
    full = bench.predict_run({**run, "levers": ["pure-bf16"], "lora_rank": None,
                              "micro_batch": 1, "accumulation": 1, "global_batch": 1})
    assert full.status == "predicted" and full.candidate.precision == "bf16"


def test_the_bench_ends_with_the_held_back_line():
    cases = [bench.predict_run(BY_ID[i]) for i in ("litgpt-llama2-7b-lora-1xa10g",
                                                    "litgpt-llama3-8b-lora-1xa10g")]
    cases = [dataclasses.replace(c, run={**c.run, "split": "held-back"}) for c in cases]
    line = bench.held_back_line(cases)
    assert re.fullmatch(r"held-back half: median peak error \d+\.\d%, worst \d+\.\d%; "
                        r"median throughput error n/a", line)
    errors = bench.errors(cases, "held-back")["peak"]
    assert f"worst {100 * max(errors):.1f}%" in line and len(errors) == 2


def test_a_qlora_run_takes_every_lever_it_names():
    case = bench.predict_run(BY_ID["torchtune-8b-qlora-1x4090"])
    c = case.candidate
    assert (c.micro_batch, c.accumulation, c.segments, c.chunked_loss) == (2, 1, 32, 8)
    assert (c.lora_rank, c.nf4_base) == (8, True)
    assert case.measured_tps == 2413 and case.measured_peak == round(7.4 * 2**30)
    a6000 = bench.predict_run(BY_ID["torchtune-8b-lora-1xa6000"])
    assert a6000.measured_tps is None and a6000.predicted_tps > 0   # a stand-in card's speeds


def test_a_replayed_run_is_what_the_planner_prints_and_an_oom_run_does_not_fit():
    # the bench's default: the step simulated and replayed through the allocator, as the
    # planner's listed rows are; GPT-2 XL's plain DDP step on one 4090 ran out of memory
    run = BY_ID["hf-fsdp-gpt2xl-ddp-1gpu-oom"]
    replayed, formulas = bench.predict_run(run, replay=True), bench.predict_run(run)
    assert (replayed.how, formulas.how) == ("replayed", "predicted")
    assert replayed.fits is False and formulas.fits is False
    assert replayed.gpu_total > replayed.budget
