"""A whole GPU session in one command: the smoke check, the GPU tests, every chapter's recording.

    python -m companion record --session                  # on the GPU machine, ~9 minutes
    python3 tasks.py gpu                                  # the same, with no setup and no pip

A lent GPU machine has a short budget and no network: the session runs from the working tree
with torch, numpy, matplotlib, tqdm and pytest only (no Jupyter), in three stages, and plans for
the budget (`budget_seconds`, 540 by default) before each one:

1. `smoke`: every device code path at tiny sizes (`companion.record.smoke`), under a minute;
2. `tests`: the tests marked `gpu` (`pytest -m gpu`), in a subprocess with its own time limit
   (twice its expected time on a GPU; in a dry run, what is left of the budget);
3. the chapters, in order, each recorded into `<out>/<machine>.json` as soon as it ends (so a
   session that is stopped keeps what it measured). A chapter is skipped when its expected time
   (the seconds this machine's results file recorded for it last time, else `EXPECTED_SECONDS`)
   no longer fits in what is left.

The summary says what ran, what failed (with the traceback) and what was skipped for time. On a
CPU (`device="cpu"`) the same session is a dry run at the smoke sizes, which CI runs so that a
change that breaks it fails there first.

Example:
    >>> summary = session("cuda", budget_seconds=540)
    >>> print(summary.table())
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import time
import traceback

import torch

from companion.record import runner
from companion.record.smoke import smoke, smoke_sizes

__all__ = ["EXPECTED_SECONDS", "Stage", "Summary", "session", "gpu_test_files"]

REPO = pathlib.Path(__file__).resolve().parents[2]

# Seconds each stage is expected to take on a GPU before a session has recorded it: estimates
# from the CPU runs at the smoke sizes, scaled for the GPU sizes (`companion.device.sizes`); the
# results file's own "seconds" replace them once a run has measured them.
EXPECTED_SECONDS = {"smoke": 60.0, "tests": 90.0, "00": 20.0, "01": 25.0, "02": 10.0,
                    "03": 25.0, "04": 40.0, "05": 40.0, "06": 60.0, "07": 60.0, "08": 40.0,
                    "09": 30.0, "10": 45.0, "11": 120.0,
                    "12": 60.0, "13": 90.0}


@dataclasses.dataclass
class Stage:
    """One stage of the session: "ok", "FAILED" or "skipped", with its seconds and details."""

    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""


@dataclasses.dataclass
class Summary:
    """What a session did, stage by stage, and where its results went."""

    device: str
    budget_seconds: float
    stages: list[Stage] = dataclasses.field(default_factory=list)
    results: pathlib.Path | None = None

    @property
    def failed(self) -> list[Stage]:
        return [s for s in self.stages if s.status == "FAILED"]

    def table(self) -> str:
        """The stages as lines, then each failure's details."""
        used = sum(s.seconds for s in self.stages)
        lines = [f"session on {self.device}: {used:.0f} s of {self.budget_seconds:.0f} s"]
        lines += [f"  {s.name:<8} {s.status:<8} {s.seconds:7.1f} s  {s.detail.splitlines()[0]}"
                  if s.detail else f"  {s.name:<8} {s.status:<8} {s.seconds:7.1f} s"
                  for s in self.stages]
        if self.results is not None:
            lines.append(f"results: {self.results}")
        for s in self.failed:
            lines += ["", f"--- {s.name} FAILED ---", s.detail]
        return "\n".join(lines)


def gpu_test_files() -> list[str]:
    """The test files that hold tests marked `gpu`."""
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in p.read_text(encoding="utf-8"))


def session(device: torch.device | str, *, budget_seconds: float = 540.0,
            out: pathlib.Path | str | None = None, chapters: list[str] | None = None,
            checks: bool = True, tests: bool = True, progress: bool = True) -> Summary:
    """Run the smoke check, the GPU tests and the chapters on `device` within `budget_seconds`.

    `out`: the folder of the results file (default `course/results`; required on a CPU, whose
    dry run must not write there). `chapters`: all by default. `checks=False` leaves out the
    smoke stage, `tests=False` the tests. Returns the `Summary`."""
    device = torch.device(device)
    if device.type == "cpu" and out is None:
        raise ValueError("a session on the CPU is a dry run: pass out=FOLDER for its results file "
                         "(course/results holds GPU runs only)")
    chapters = list(runner.CHAPTERS) if chapters is None else chapters
    sizes = smoke_sizes(device) if device.type == "cpu" else None
    summary = Summary(str(device), budget_seconds)
    start = time.monotonic()

    def left() -> float:
        return budget_seconds - (time.monotonic() - start)
    expected = _expected(device, out)
    stages = [("smoke", lambda: _smoke(device))] if checks else []
    # The GPU tests' own limit: on a GPU twice their expected time, so that a hang leaves the
    # chapters their time. In a dry run they all skip, and collecting them is the host's work, as
    # slow as its load makes it (16 s of the 30 it had, on a busy 2-core CI machine): only the
    # budget limits them there.
    if tests:
        cap = float("inf") if device.type == "cpu" else 2 * expected["tests"]
        stages.append(("tests", lambda: _tests(min(left(), cap))))
    stages += [(c, lambda c=c: _chapter(c, device, out, sizes, summary)) for c in chapters]
    for name, run in stages:
        if expected.get(name, 60.0) > left():
            summary.stages.append(Stage(name, "skipped", 0.0,
                                        f"expected {expected.get(name, 60.0):.0f} s, "
                                        f"{max(left(), 0):.0f} s left"))
            continue
        began = time.perf_counter()  # host clock
        try:
            status, detail = run()
        except Exception:                        # one stage's failure must not end the session
            status, detail = "FAILED", traceback.format_exc()
        seconds = time.perf_counter() - began   # host clock: a stage's wall time, syncs inside
        summary.stages.append(Stage(name, status, seconds, detail))
        if progress:
            print(f"{name}: {status} ({seconds:.1f} s)", flush=True)
    return summary


def _expected(device: torch.device, out) -> dict[str, float]:
    """EXPECTED_SECONDS, with the seconds this machine's results file recorded per chapter."""
    expected = dict(EXPECTED_SECONDS)
    if device.type == "cpu":                     # the dry run: small sizes, quick stages
        return {name: min(seconds, 15.0) for name, seconds in expected.items()}
    path = pathlib.Path(out or runner.RESULTS_DIR) / runner.file_name(runner.machine(device))
    if path.exists():
        for chapter, rec in json.loads(path.read_text(encoding="utf-8"))["chapters"].items():
            expected[chapter] = float(rec.get("seconds", expected.get(chapter, 60.0)))
    return expected


def _smoke(device: torch.device) -> tuple[str, str]:
    rows = smoke(device, progress=False)
    failed = [f"{name}: {note}" for name, passed, _, note in rows if not passed]
    if failed:
        return "FAILED", "\n".join(failed)
    return "ok", f"{len(rows)} checks passed"


def _tests(timeout: float) -> tuple[str, str]:
    """`pytest -m gpu` over the files that hold GPU tests, in a subprocess of this Python."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "-p", "no:nbval",                     # the notebook plugin, where it is installed
           "--continue-on-collection-errors", *gpu_test_files()]
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        return "FAILED", f"the GPU tests ran past {timeout:.0f} s and were stopped"
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode in (0, 5):               # 5: every test deselected or skipped
        return "ok", last
    return "FAILED", f"{last}\n{done.stdout[-4000:]}{done.stderr[-2000:]}"


def _chapter(chapter: str, device: torch.device, out, sizes, summary: Summary) -> tuple[str, str]:
    path, failed = runner.record([chapter], device=device, out=out, base_sizes=sizes,
                                 progress=False)
    summary.results = path
    if chapter in failed:
        return "FAILED", failed[chapter]
    return "ok", "recorded"
