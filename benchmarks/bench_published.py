"""The planner against published runs: each run of the corpus predicted with its own levers.

    python benchmarks/bench_published.py                  # every run of the corpus
    python benchmarks/bench_published.py --split held-back

Reads `companion/plan/published_runs.json` (runs published by torchtitan, torchtune, litgpt,
IBM's fms-fsdp and Hugging Face, each with its quoted line: model, GPUs, batch, sequence, levers,
the measured peak and/or tokens per second, or "out of memory"). Each run becomes one fixed
plan, a `Candidate` with the run's own levers (no search), and goes through the planner's public
functions:
`load_config` and `GPTShape.of` (the model), `predict_memory` (the tensors at the peak),
`plan.budget.lines` and `plan.budget.fit_predicted` (the lines beyond the tensors: context,
workspaces, NCCL, headroom; the GPU total and whether it fits the card), `predict_seconds` under
`CostModel.for_gpu` (the step time, hence tokens per second per GPU).

The measured peak is compared with the predicted figure of the same counter: "allocated"
(`max_memory_allocated`) with the tensors and the allocator's workspaces, "reserved"
(`max_memory_reserved`) with what the allocator reserves (`Fit.reserved`), "nvidia-smi" with the
GPU total (`Fit.total`, every line). Errors are predicted / measured - 1. It prints every run,
then the median and worst |error| of peak memory and of throughput on each split ("fit" runs may
calibrate constants; "held-back" runs report the error), says for the runs recorded as out of
memory whether the planner prints their plan as fitting, and ends with the held-back line.

A run whose levers the planner does not have yet is reported "not expressible yet", with the
lever, and left out of the errors; `LEVERS` below is the one place that says which Candidate
field each lever name becomes. A benchmark, not a test: nothing here asserts on the errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from typing import Callable

from companion.cost import gpus
from companion.memory import format_bytes
from companion.plan import (TECHNIQUES, Candidate, CostModel, GPTShape, candidates, load_config,
                            predict_memory, predict_seconds, simulate)
from companion.plan import budget as budgets

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "companion" / "plan" / "published_runs.json"
SPLITS = ("fit", "held-back")
KINDS = ("allocated", "reserved", "nvidia-smi")
OUTCOMES = ("ran", "out of memory")


# Each lever name of the corpus (the CLI's `--allow` names) and the Candidate fields it sets.
# A dict: fixed fields ({}: none, as "compile", which only picks the cost model's compiled
# factor); a function of (run, shape): fields read off the run; NO_LEVER: none is planned, the
# run is not expressible. A combination Candidate refuses makes the run
# "not expressible".
NO_LEVER = "no planner lever"
LEVERS: dict[str, dict | Callable | str] = {
    # every block wrapped, the last too: torchtune's set_activation_checkpointing, torchtitan's
    # full AC, fms-fsdp's apply_fsdp_checkpointing and litgpt's FSDP policy wrap each block
    "checkpointing": lambda run, shape: {"segments": shape.depth, "checkpoint_last": True},
    "selective-checkpointing": {"selective": True},
    "autocast": {"precision": "autocast"},        # 16-bit compute on fp32 weights (FSDP's bf16)
    "mixed": {"precision": "mixed"},              # bf16 weights + fp32 master
    "pure-bf16": {"precision": "bf16"},           # bf16 weights and states, no master
    "zero-1": {"zero_stage": 1}, "zero-2": {"zero_stage": 2}, "zero-3": {"zero_stage": 3},
    "offload": {"offload": True},
    "lora": lambda run, shape: {"lora_rank": run["lora_rank"],
                                "lora_targets": _targets(run, shape)},
    "qlora": lambda run, shape: {"lora_rank": run["lora_rank"], "nf4_base": True,
                                 "lora_targets": _targets(run, shape),
                                 "nf4_keeps_inputs": _before(run.get("bitsandbytes"), (0, 43, 2))},
    "adam8bit": {"state_bits": 8},
    "paged-adam8bit": {"state_bits": 8, "paged": True},
    "optimizer-in-backward": {"in_backward": True},
    "chunked-loss": lambda run, shape: {"chunked_loss": run["loss_chunks"]},
    "compile": {},                                # no field: the cost model's compiled factor
    "float8": NO_LEVER,
    "fsdp-cpu-offload": NO_LEVER,                 # parameters on the host, brought per module
    "hsdp": NO_LEVER,                             # sharded within a node, replicated across
}


def _targets(run: dict, shape: GPTShape) -> tuple[str, ...]:
    """The run's adapted Linears (its `lora_targets`) as `Candidate.lora_targets` names them:
    () when it adapts every Linear of a block."""
    targets = tuple(run.get("lora_targets", ()))
    return () if set(targets) == set(shape.block_linears()) else targets


def _before(version: str | None, fixed: tuple[int, ...]) -> bool:
    """Whether a run's library `version` ("0.42.0"; None: not recorded, taken as recent) is
    older than `fixed`."""
    return version is not None and tuple(int(p) for p in version.split(".")[:3]) < fixed


# Under LoRA and QLoRA the base is frozen: pure bf16 and "mixed" keep the same bf16 base and
# differ only by the adapters' fp32 copies (4·r·(in + out) bytes a Linear, under 0.2 GB for the
# corpus's runs). The planner plans pure bf16 without adapters only, so such runs are predicted
# as "mixed" (marked "~").
ADAPTER_FALLBACK = {"pure-bf16": {"precision": "mixed"}}


@dataclasses.dataclass
class Case:
    """One run predicted: what was measured beside what the planner says."""

    run: dict
    status: str                        # "predicted", "~" (approximated), or why not
    candidate: Candidate | None = None
    measured_peak: int | None = None   # bytes, of the counter `kind`
    predicted_peak: int | None = None  # bytes, the same counter
    gpu_total: int | None = None       # tensors + every line
    budget: int | None = None
    fits: bool | None = None
    measured_tps: float | None = None  # tokens per second per GPU
    predicted_tps: float | None = None
    how: str = ""                      # "predicted" (formulas) or "replayed" (simulated step)

    @property
    def peak_error(self) -> float | None:
        if self.measured_peak is None or self.predicted_peak is None:
            return None
        return self.predicted_peak / self.measured_peak - 1

    @property
    def tps_error(self) -> float | None:
        if self.measured_tps is None or self.predicted_tps is None:
            return None
        return self.predicted_tps / self.measured_tps - 1


def load_runs(path: pathlib.Path | str = CORPUS) -> list[dict]:
    """The corpus's runs, each checked for the fields the bench reads."""
    runs = json.loads(pathlib.Path(path).read_text())["runs"]
    for run in runs:
        where = f"{path}: run {run.get('id', '?')!r}"
        for key in ("id", "source", "quote", "model", "gpu", "planner_gpu", "gpus", "micro_batch",
                    "accumulation", "global_batch", "seq_len", "levers", "measured", "split"):
            if key not in run:
                raise ValueError(f"{where} has no {key!r}")
        if run["split"] not in SPLITS:
            raise ValueError(f"{where}: split must be one of {SPLITS}, got {run['split']!r}")
        unknown = [lever for lever in run["levers"] if lever not in LEVERS]
        if unknown:
            raise ValueError(f"{where}: unknown lever(s) {unknown}; known: {', '.join(LEVERS)}")
        measured = run["measured"]
        if measured.get("outcome") not in OUTCOMES:
            raise ValueError(f"{where}: measured.outcome must be one of {OUTCOMES}")
        if ("peak_gib" in measured or "peak_gb" in measured) and \
                measured.get("peak_kind") not in KINDS:
            raise ValueError(f"{where}: a measured peak needs peak_kind, one of {KINDS}")
        if run["global_batch"] != run["micro_batch"] * run["accumulation"] * run["gpus"]:
            raise ValueError(f"{where}: global_batch is not micro_batch x accumulation x gpus")
    return runs


def measured_peak_bytes(run: dict) -> int | None:
    """The measured peak in bytes: GiB (2^30) or GB (1e9), as the source prints it."""
    m = run["measured"]
    if "peak_gib" in m:
        return round(m["peak_gib"] * 2**30)
    if "peak_gb" in m:
        return round(m["peak_gb"] * 1e9)
    return None


def build_candidate(run: dict, shape: GPTShape) -> tuple[Candidate | None, str]:
    """The run's plan as a Candidate, and "predicted", "~" (a lever approximated) or the reason it
    cannot be expressed."""
    fields, approximated = {"micro_batch": run["micro_batch"],
                            "accumulation": run["accumulation"]}, False
    adapters = bool({"lora", "qlora"} & set(run["levers"]))
    for lever in run["levers"]:
        spec = LEVERS[lever]
        if spec == NO_LEVER:
            return None, f"not expressible: the planner has no lever for {lever}"
        spec = spec(run, shape) if callable(spec) else spec
        if adapters and lever in ADAPTER_FALLBACK and not _accepts({**spec, "lora_rank": 8}):
            spec, approximated = ADAPTER_FALLBACK[lever], True
        fields.update(spec)
    try:
        cand = Candidate(**fields)
    except (TypeError, ValueError) as e:
        missing = [lv for lv in run["levers"] if isinstance(LEVERS[lv], dict)
                   and not _accepts(LEVERS[lv])]
        return None, f"not expressible yet: {', '.join(missing) or e}"
    searched = dataclasses.replace(cand, checkpoint_last=False,   # predicted, not searched
                                   nf4_keeps_inputs=False)
    if searched not in candidates(shape, run["global_batch"], world_size=run["gpus"],
                                  allow=TECHNIQUES, lora_rank=cand.lora_rank or 8,
                                  lora_targets=cand.lora_targets):
        return None, "not expressible yet: the planner does not search this combination"
    return cand, "~" if approximated else "predicted"


def _accepts(fields: dict) -> bool:
    """Whether Candidate has these fields and takes their values."""
    try:
        Candidate(1, **fields, **({"lora_rank": 8} if fields.get("nf4_base") else {}))
    except (TypeError, ValueError):
        return False
    return True


def budget_bytes(run: dict, card) -> int:
    """The card's bytes the plan must fit: the total capacity the run's own out-of-memory message
    quotes, else a nominal size the source gives for a card not in `companion.cost.gpus`, else
    the planner's budget for the card (`plan.named.plan_named`'s default: what CUDA reports of
    it, `gpus.GPU.usable_bytes`)."""
    if run.get("capacity_gib"):
        return round(run["capacity_gib"] * 2**30)
    if run.get("budget_gib"):
        return round(run["budget_gib"] * 2**30)
    return card.usable_bytes


def predict_run(run: dict, *, replay: bool = False) -> Case:
    """One run through the planner (see the module docstring): its formulas, or with
    `replay=True` its step simulated and replayed through the caching allocator, as the
    planner's listed rows are (`plan.simulate`, `budget.fit_simulated`)."""
    if run.get("usable") is False:
        return Case(run, f"unusable: {run['unusable_why']}")
    model_fn = load_config(run["model"]).model_fn(run["seq_len"])
    shape = GPTShape.of(model_fn)
    cand, status = build_candidate(run, shape)
    if cand is None:
        return Case(run, status)
    card, world = gpus.gpu(run["planner_gpu"]), run["gpus"]
    pred = predict_memory(shape, cand, world_size=world, device_type="cuda")
    found = budgets.lines(shape, cand, device_type="cuda", gpu=card, world_size=world)
    budget = budget_bytes(run, card)
    peak = pred.peak
    if replay and cand.paged:       # each 2^20-value page's 8-bit step simulated: tens of
        replay = False              # minutes for an 8B model; its formulas (marked "f")
    if replay:
        tracker = simulate(model_fn, cand, world_size=world, device_type="cuda", shape=shape)
        fit, peak = budgets.fit_simulated(tracker, pred.parameters, budget, found, "cuda"), \
            tracker.peak
    else:       # the largest request sets the headroom, as the planner's rows do (planner._rows)
        tokens = cand.micro_batch * shape.seq_len
        largest = 4 * max(shape.largest, tokens * shape.vocab // max(cand.chunked_loss, 1))
        fit = budgets.fit_predicted(pred.peak, pred.parameters, largest, budget, found, "cuda")
    kind = run["measured"].get("peak_kind")
    in_step = sum(o.bytes for o in fit.lines if o.in_allocator and o.alive == "step")
    same_counter = {"allocated": peak + in_step, "reserved": fit.reserved,
                    "nvidia-smi": fit.total}.get(kind)
    cost = CostModel.for_gpu(card.name, compiled="compile" in run["levers"],   # its factor,
                             world_size=run["gpus"])                          # its ring's link
    seconds = predict_seconds(shape, cand, cost, world_size=world)
    compare_tps = run.get("compare_throughput", True)
    measured = measured_peak_bytes(run) if run.get("compare_peak", True) else None
    return Case(run, status, cand, measured, same_counter, fit.total, budget,
                fit.fits, run["measured"].get("tokens_per_s_per_gpu") if compare_tps else None,
                cand.micro_batch * cand.accumulation * shape.seq_len / seconds["total"],
                fit.how)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def print_cases(cases: list[Case]) -> None:
    """Every run: measured and predicted peak (GiB, same counter) and tokens/s per GPU."""
    head = (f"{'run':<52}{'split':<10}{'measured':>10}{'kind':>11}{'predicted':>10}{'error':>9}"
            f"{'GPU total':>10}{'budget':>8}{'fits':>6}{'tok/s':>8}{'pred.':>8}{'error':>9}")
    print(head)
    print("-" * len(head))
    for c in cases:
        r, m = c.run, c.run["measured"]
        measured = "OOM" if m["outcome"] == "out of memory" else _gib(c.measured_peak
                                                                     or measured_peak_bytes(r))
        mark = "~" if c.status == "~" else " "
        if c.candidate is None:
            print(f"{r['id']:<52}{r['split']:<10}{measured:>10}   {c.status}")
            continue
        tps = m.get("tokens_per_s_per_gpu")
        print(f"{r['id']:<51}{mark}{r['split']:<10}{measured:>10}{m.get('peak_kind', '-'):>11}"
              f"{_gib(c.predicted_peak):>10}{_pct(c.peak_error):>9}{_gib(c.gpu_total):>10}"
              f"{_gib(c.budget):>8}{'yes' if c.fits else 'no':>6}"
              f"{tps if tps is not None else '-':>8}{c.predicted_tps:>8.0f}{_pct(c.tps_error):>9}")
        print(f"{'':4}{c.candidate.describe()} on {r['gpus']} x {r['planner_gpu']} ({c.how})")


def errors(cases: list[Case], split: str) -> dict[str, list[float]]:
    """|error| of peak memory and of throughput over the runs of `split`."""
    mine = [c for c in cases if c.run["split"] == split]
    return {"peak": [abs(c.peak_error) for c in mine if c.peak_error is not None],
            "throughput": [abs(c.tps_error) for c in mine if c.tps_error is not None]}


def _summary(values: list[float]) -> str:
    if not values:
        return "no runs"
    return (f"median {100 * statistics.median(values):.1f}%, worst {100 * max(values):.1f}% "
            f"over {len(values)} runs")


def oom_report(cases: list[Case]) -> list[str]:
    """For runs recorded as out of memory: whether the planner prints their plan as fitting."""
    out = []
    for c in cases:
        if c.run["measured"]["outcome"] != "out of memory":
            continue
        verdict = (c.status if c.candidate is None else
                   f"printed as FITTING ({format_bytes(c.gpu_total)} of {format_bytes(c.budget)})"
                   if c.fits else f"not fitting ({format_bytes(c.gpu_total)} of "
                                  f"{format_bytes(c.budget)})")
        out.append(f"  {c.run['id']}: {verdict}")
    return out


def held_back_line(cases: list[Case]) -> str:
    """The closing line: the held-back half's median and worst peak error, median throughput."""
    e = errors(cases, "held-back")
    median = {k: f"{100 * statistics.median(v):.1f}%" if v else "n/a" for k, v in e.items()}
    worst = f"{100 * max(e['peak']):.1f}%" if e["peak"] else "n/a"
    return (f"held-back half: median peak error {median['peak']}, worst {worst}; "
            f"median throughput error {median['throughput']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(CORPUS), help="the runs' JSON file")
    parser.add_argument("--split", choices=SPLITS, help="only the runs of this split")
    parser.add_argument("--formulas", action="store_true",
                        help="the formulas only (seconds), not each step simulated and replayed "
                             "through the allocator as the planner's listed rows are (minutes)")
    args = parser.parse_args()
    runs = [r for r in load_runs(args.corpus) if args.split in (None, r["split"])]
    cases = []
    for r in runs:                                   # what is done, as it is done (minutes)
        began = time.perf_counter()
        cases.append(predict_run(r, replay=not args.formulas))
        print(f"{r['id']}: {cases[-1].how or cases[-1].status} in "
              f"{time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    print_cases(cases)
    print("\n~: predicted with a lever approximated (pure bf16 under adapters "
          "as bf16 + fp32 master)")
    for split in SPLITS:
        e = errors(cases, split)
        print(f"{split}: peak {_summary(e['peak'])}; throughput {_summary(e['throughput'])}")
    oom = oom_report(cases)
    fitting = sum("FITTING" in line for line in oom)
    print(f"\nRuns recorded as out of memory ({len(oom)}); the planner prints {fitting} of "
          f"them as fitting:")
    print("\n".join(oom))
    ran_not = [c.run["id"] for c in cases if c.fits is False
               and c.run["measured"]["outcome"] == "ran"]
    print(f"Runs that ran but are predicted not to fit: {', '.join(ran_not) or 'none'}")
    print(held_back_line(cases))


if __name__ == "__main__":
    main()
