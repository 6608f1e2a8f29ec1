"""companion.record: `python -m companion record` on the CPU (its CI path), the schema it writes,
and the smoke run. Every file goes to a tmp folder: nothing here writes into course/results."""
import datetime
import json
import os
import pathlib

import pytest
import torch

from companion import estimate, results
from companion.__main__ import main
from companion.device import sizes
from companion.record import runner, smoke
from companion.record.runner import CHAPTERS, record, validate


def _record(tmp_path, chapters, **kw):
    return record(chapters, device="cpu", out=tmp_path, repeats=1, progress=False, **kw)


def test_a_cpu_run_writes_each_chapter_with_its_sizes_measured_and_predicted(tmp_path):
    path, failed = _record(tmp_path, ["01", "02"])
    assert failed == {}
    assert path.parent == tmp_path and path.name.startswith("cpu-") and path.suffix == ".json"
    saved = json.loads(path.read_text())
    validate(saved)
    assert (saved["device"], saved["torch"]) == ("cpu", torch.__version__)
    assert saved["cuda"] == torch.version.cuda          # the build's CUDA (None on a CPU build)
    assert saved["date"] == datetime.date.today().isoformat()
    assert list(saved["chapters"]) == ["01", "02"]
    ch01 = saved["chapters"]["01"]
    S = sizes("cpu")
    assert ch01["sizes"] == {"width": S.width, "batch": S.batch}       # what it read, no more
    assert ch01["measured"]["activation_bytes"] == ch01["predicted"]["activation_bytes"]
    assert ch01["measured"]["activation_bytes"]["x"] == [1, 8, S.batch, 4 * S.batch,
                                                         16 * S.batch]
    assert ch01["measured"]["parameter_bytes"] == 4 * estimate.mlp_params(64, S.width, 3, 10)
    ch02 = saved["chapters"]["02"]
    assert ch02["sizes"] == {} and ch02["measured"]["torch_sum_1000_bf16"] == pytest.approx(10.0,
                                                                                           rel=1e-2)


def test_recording_a_chapter_again_replaces_it_and_keeps_the_others(tmp_path, monkeypatch):
    path, _ = _record(tmp_path, ["01", "02"])
    first = json.loads(path.read_text())
    monkeypatch.setitem(CHAPTERS, "01", lambda S, device, repeats: {
        "experiment": "again", "measured": {"width": S.width}, "predicted": {}})
    _record(tmp_path, ["01"])
    again = json.loads(path.read_text())
    assert again["chapters"]["02"] == first["chapters"]["02"]
    assert again["chapters"]["01"]["experiment"] == "again"
    assert again["chapters"]["01"]["sizes"] == {"width": sizes("cpu").width}


def test_a_failing_chapter_is_reported_and_not_written(tmp_path, monkeypatch):
    def broken(S, device, repeats):
        raise RuntimeError("out of something")

    monkeypatch.setitem(CHAPTERS, "02", broken)
    path, failed = _record(tmp_path, ["02", "01"])
    assert list(failed) == ["02"] and "RuntimeError: out of something" in failed["02"]
    assert list(json.loads(path.read_text())["chapters"]) == ["01"]


def test_an_experiment_that_returns_a_bad_value_is_not_written(tmp_path, monkeypatch):
    monkeypatch.setitem(CHAPTERS, "01", lambda S, device, repeats: {
        "experiment": "bad", "measured": {"curve": {"x": [1, 2], "y": [1]}}, "predicted": {}})
    with pytest.raises(ValueError, match="a value is a number, a string or a curve"):
        _record(tmp_path, ["01"])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("break_it, message", [
    (lambda r: r.pop("chapters"), "needs 'chapters'"),
    (lambda r: r["chapters"].update({"4": r["chapters"]["01"]}), "two digits"),
    (lambda r: r["chapters"]["01"].pop("predicted"), "needs 'predicted'"),
    (lambda r: r["chapters"]["01"]["sizes"].update(width=1.5), "whole numbers"),
    (lambda r: r["chapters"]["01"]["measured"].update(peak=[1, 2]), "a value is a number"),
    (lambda r: r["chapters"]["01"]["measured"].update(c={"x": [1], "y": ["a"]}),
     "a value is a number"),
])
def test_validate_rejects_what_the_notebooks_could_not_read(break_it, message):
    good = {"machine": "m", "device": "cuda", "torch": "2", "cuda": "12", "date": "d",
            "chapters": {"01": {"experiment": "e", "date": "d", "seconds": 1.0,
                                "sizes": {"width": 8}, "predicted": {},
                                "measured": {"a": 1, "b": "x", "c": {"x": [1], "y": [2.0]}}}}}
    validate(good)
    break_it(good)
    with pytest.raises(ValueError, match=message):
        validate(good)


def test_file_names_say_which_machine():
    assert runner.file_name({"machine": "NVIDIA H200", "gpus": 1}) == "nvidia-h200.json"
    assert runner.file_name({"machine": "NVIDIA A100-SXM4-80GB", "gpus": 8}) == \
        "8x-nvidia-a100-sxm4-80gb.json"
    assert runner.file_name({"machine": "CPU x86_64"}) == "cpu-x86-64.json"


def test_the_command_line_records_on_the_cpu_into_the_folder_given(tmp_path, capsys):
    assert main(["record", "--device", "cpu", "--chapters", "01", "--out", str(tmp_path)]) == 0
    files = list(tmp_path.glob("*.json"))
    assert capsys.readouterr().out.strip() == f"wrote {files[0]}"
    assert list(json.loads(files[0].read_text())["chapters"]) == ["01"]


def test_the_command_line_keeps_cpu_runs_out_of_course_results(capsys):
    before = sorted(results.RESULTS_DIR.glob("*")) if results.RESULTS_DIR.exists() else None
    assert main(["record", "--device", "cpu", "--chapters", "01"]) == 2
    assert "Pass --out FOLDER" in capsys.readouterr().err
    after = sorted(results.RESULTS_DIR.glob("*")) if results.RESULTS_DIR.exists() else None
    assert after == before


def test_the_command_line_names_an_unknown_chapter(capsys):
    assert main(["record", "--device", "cpu", "--chapters", "42", "--out", "unused"]) == 2
    assert "no recorded experiment for chapter(s) 42" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_command_line_says_when_cuda_is_missing(capsys):
    assert main(["record", "--device", "cuda", "--out", "unused"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err


def test_smoke_reports_a_failing_path_and_the_command_line_fails(monkeypatch, capsys):
    def broken(S, device, repeats):
        return {"experiment": "x", "measured": {"v": [1]}, "predicted": {}}

    monkeypatch.setitem(CHAPTERS, "02", broken)
    rows = smoke.smoke("cpu", chapters=["01", "02"], checks=["memory.track"], progress=False)
    assert [(name, ok) for name, ok, _, _ in rows] == [
        ("memory.track", True), ("chapter 01", True), ("chapter 02", False)]
    assert "a value is a number" in rows[-1][3]
    only_tracker = {"memory.track": smoke._checks(torch.device("cpu"))["memory.track"]}
    monkeypatch.setattr(smoke, "_checks", lambda device: only_tracker)
    assert main(["record", "--smoke", "--device", "cpu", "--chapters", "02"]) == 1
    assert "FAILED: chapter 02" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.gpu
def test_smoke_on_the_gpu():
    rows = smoke.smoke("cuda", progress=False)
    assert {name: note for name, ok, _, note in rows if not ok} == {}
    assert "gloo with CUDA tensors" in smoke.check_names("cuda")


@pytest.mark.gpu
def test_a_gpu_run_of_one_chapter(tmp_path):
    path, failed = record(["01"], device="cuda", out=tmp_path, repeats=1, progress=False,
                          base_sizes=smoke.SMOKE_SIZES)
    saved = json.loads(path.read_text())
    assert failed == {} and saved["device"] == "cuda" and saved["cuda"] == torch.version.cuda
    assert saved["size_class_gb"] in (None, 16, 24, 40, 80)
    assert results.recorded("01", results_dir=tmp_path)[0]["machine"] == saved["machine"]


# ---------------------------------------------------------------- the GPU session, dry run on the CPU

def test_the_session_goes_past_a_failing_chapter_and_skips_what_does_not_fit(tmp_path, monkeypatch):
    from companion.record import runner, session as S

    def broken(S_, device, repeats):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setitem(runner.CHAPTERS, "02", broken)
    summary = S.session("cpu", out=tmp_path, chapters=["01", "02", "03"], checks=False,
                        tests=False, progress=False)
    status = {s.name: s.status for s in summary.stages}
    assert status == {"01": "ok", "02": "FAILED", "03": "ok"}
    assert "illegal memory access" in summary.failed[0].detail and "Traceback" in \
        summary.failed[0].detail
    assert "--- 02 FAILED ---" in summary.table()
    tight = S.session("cpu", out=tmp_path, chapters=["01", "03"], checks=False, tests=False,
                      budget_seconds=5.0, progress=False)           # each is expected to take 15 s
    assert [(s.name, s.status) for s in tight.stages] == [("01", "skipped"), ("03", "skipped")]
    assert "expected 15 s, 5 s left" in tight.stages[0].detail


def test_the_gpu_tests_limit_is_twice_their_expected_time_on_a_gpu_and_the_budget_in_a_dry_run(
        tmp_path, monkeypatch):
    """On a GPU a hang in the tests must leave the chapters their time. A dry run's GPU tests only
    collect and skip, as slowly as the machine's load makes them: its budget alone limits them (a
    limit of 30 s stopped them once on a loaded CI machine)."""
    from companion.record import session as S
    limits = []
    monkeypatch.setattr(S, "_tests", lambda timeout: limits.append(timeout) or ("ok", ""))
    monkeypatch.setattr(S, "_expected", lambda device, out: {**S.EXPECTED_SECONDS, "tests": 15.0})
    for device in ("cuda", "cpu"):
        S.session(device, out=tmp_path, chapters=[], checks=False, budget_seconds=1000.0,
                  progress=False)
    assert limits[0] == 30.0 and 990 < limits[1] <= 1000


_NO_JUPYTER = '''
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"IPython", "ipykernel", "ipywidgets", "jupyter_client",
                                  "jupyterlab", "nbclient", "nbformat", "nbval", "notebook"}:
            raise ImportError(f"{name} is not installed on a GPU machine")
sys.meta_path.insert(0, _Absent())
'''


@pytest.mark.timeout(2400)      # longer than the run's own limits below (not pyproject's 300 s)
def test_tasks_gpu_dry_runs_the_whole_session_without_setup_and_without_jupyter(tmp_path):
    """What `python3 tasks.py gpu` runs on a GPU machine (torch, numpy, matplotlib, tqdm and
    pytest; no Jupyter, no network), here at the smoke sizes: CI runs it, so a change that breaks
    the GPU session fails here first."""
    import subprocess
    import sys
    (tmp_path / "sitecustomize.py").write_text(_NO_JUPYTER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    repo = pathlib.Path(__file__).resolve().parent.parent
    # The budget is a GPU lease's, not this test's: 1800 s, ~40x what the dry run takes on a busy
    # 2-core CI machine, so that no load skips a stage here (the skipping is tested above, with a
    # budget of 5 s); the time limits only end a hang.
    done = subprocess.run([sys.executable, str(repo / "tasks.py"), "gpu", "--device", "cpu",
                           "--out", str(tmp_path / "out"), "--budget-seconds", "1800"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=2000)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for stage in ["smoke", "tests", *CHAPTERS]:
        assert f"  {stage:<8} ok " in done.stdout, done.stdout[-3000:]
    checks = len(smoke.check_names("cpu")) + len(CHAPTERS)     # the smoke stage: every check,
    assert f"{checks} checks passed" in done.stdout             # then every chapter (2 gloo ranks
                                                                # for the parallel ones)
    assert "== " not in done.stdout                    # no setup step ran
    saved = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    validate(saved)
    assert sorted(saved["chapters"]) == sorted(CHAPTERS)


def test_chapter_01s_batch_sweep_leaves_out_a_workspace_made_on_the_first_matmul(monkeypatch):
    """On a GPU, cuBLAS allocates its workspace on the first matmul and keeps it: emulated here by
    a model whose first forward keeps a 1 MiB buffer. Batch 1 must not count it."""
    from companion.record import basics
    kept = []

    class FirstCallKeepsAWorkspace(basics.MLP):
        def forward(self, x):
            if not kept:
                kept.append(torch.empty(2**18))               # 1 MiB, alive from then on
            return super().forward(x)
    monkeypatch.setattr(basics, "MLP", FirstCallKeepsAWorkspace)
    S = smoke.SMOKE_SIZES
    run = basics.batch_activations(S, torch.device("cpu"))
    measured = run["measured"]["activation_bytes"]
    assert measured["x"][0] == 1 and measured["y"][0] == 1 * 3 * S.width * 4


def test_chapter_03_counts_adams_foreach_temporaries_as_on_a_gpu():
    """torch.optim.Adam defaults to foreach on CUDA: its step holds √v of every tensor at once,
    4 bytes per parameter, more than the activations the budget leaves room for at a GPU's widths.
    Emulated on the CPU with foreach=True (the same code path) at such a width: the budget holds
    the step, the prediction finds a batch, and measured peaks follow it."""
    import dataclasses
    from companion.record import basics
    from companion.record.common import SizesRead
    S = SizesRead(dataclasses.replace(sizes("cpu"), width=512, depth=4, batch=8))
    run = basics.batch_memory(S, torch.device("cpu"), foreach=True)
    measured, predicted = run["measured"], run["predicted"]
    temporaries = basics.adam_temporaries(S, foreach=True)
    assert temporaries > 6 * S.batch * (S.depth + 2) * S.width * 4    # the GPU case
    assert abs(measured["largest_batch"] - predicted["largest_batch"]) <= 0.01 * \
        predicted["largest_batch"]
    for got, want in zip(measured["peak_bytes"]["y"], predicted["peak_bytes"]["y"]):
        assert abs(got - want) <= 0.01 * want


def test_the_gpu_smoke_capstone_is_sized_against_the_caching_allocator():
    """On CUDA a budget caps the allocator's segments (2 and 20 MiB): the CPU smoke's 8 MiB is
    below one. The GPU smoke sizes keep the planner's margin above the allocator's headroom, the
    unconstrained run above the budget, and a plan under it (predicted here, on the CPU)."""
    from companion import allocator
    from companion.plan import Candidate, GPTShape, capstone_model, plan, predict_memory
    cpu, gpu = smoke.smoke_sizes("cpu"), smoke.smoke_sizes("cuda")
    assert cpu == smoke.SMOKE_SIZES and cpu.cap_budget < allocator.headroom(2**20 + 1)
    model_fn = capstone_model(gpu)
    shape = GPTShape.of(model_fn)
    largest = 4 * 4 * gpu.cap_width * gpu.cap_width              # the MLP's (4w, w) weight
    assert 0.1 * gpu.cap_budget >= allocator.headroom(largest)
    unconstrained = predict_memory(shape, Candidate(gpu.cap_batch), device_type="cuda").peak
    assert unconstrained > gpu.cap_budget
    chosen = plan(model_fn, gpu.cap_batch, budget=gpu.cap_budget, device="cpu", margin=0.1)
    assert chosen.chosen.techniques() and chosen.chosen_row.predicted.peak <= 0.9 * gpu.cap_budget


@pytest.mark.parametrize("foreach, device_type", [(None, "cpu"), (True, "cuda")])
def test_the_mlp_step_peak_counts_adams_temporaries_where_the_peak_falls(foreach, device_type):
    """Chapter 00's MLP: a first Adam step measured against `mlp_step_peak`, with the CPU's
    per-tensor loop and with foreach, CUDA's default (the same code path on the CPU; the CUDA
    prediction also rounds to 512-byte blocks: a few hundred bytes here)."""
    from companion.memory import track
    from companion.models import MLP, make_classification
    from companion.record.fit import mlp_step_bytes, mlp_step_peak
    S = sizes("cpu")
    X, y = make_classification(S.batch, S.width, 10, seed=0)
    with track("cpu") as t:
        model = MLP(S.width, S.width, S.depth, 10, seed=0)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
        model.loss(X, y).backward()
        opt.step()
    predicted = mlp_step_peak(S.width, S.width, S.depth, 10, batch=S.batch,
                              device_type=device_type)
    assert abs(predicted - t.peak) <= 0.001 * t.peak
    classic = mlp_step_bytes(S.width, S.width, S.depth, 10, batch=S.batch)
    if foreach:                          # the sum leaves out foreach's 4 bytes per parameter
        assert t.peak > 1.15 * classic


def test_three_plans_recorded_under_their_budgets_predicted_beside_measured():
    """What the GPU session records for chapter 09's planner (issue 33), run here on the CPU at
    the smoke sizes: each plan trains under its budget, the prediction beside the measurement."""
    from companion.record.capstone import plans_on_gpu
    rows = plans_on_gpu(smoke.SMOKE_SIZES, torch.device("cpu"), steps=2)
    assert len(rows) == 3 and all("failed" not in r for r in rows)
    for r in rows:
        assert r["measured_allocated_bytes"] <= r["budget_bytes"]
        assert r["predicted_reserved_bytes"] <= r["budget_bytes"]
        assert r["measured_step_seconds"] > 0 and r["predicted_step_seconds"] > 0
