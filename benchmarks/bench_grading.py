"""The grader on every chapter: false positives, copies caught, and what it costs.

    python benchmarks/bench_grading.py [--jobs 2] [--chapters 00 01 ...]

For each chapter, two notebooks (the setup cell and the exercise cells, as the grading tests build
them) are graded in one batch: the course's own solution cells copied ("course"), which must score
`reference` on every exercise, and the same answers each with a line of the learner's own
("learner", `grading_notebooks.trimmed`), which go through the clean room and must pass every
exercise with no review flag. The table gives each notebook's grading time.
Not a test: the times are this machine's, and the run takes several minutes.

    python benchmarks/bench_grading.py --compare --chapters 01 04

`--compare` prices the kernel sandbox (bubblewrap, `companion.grader.confine`): the same batch is
graded four times, with it, without it (`--trusted`), without, with (ABBA order, so that a drift
of the machine's speed falls on both), and each notebook's two times per mode are averaged.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import grading_notebooks as gn  # noqa: E402


def grade(folder: pathlib.Path, out: pathlib.Path, jobs: int,
          *extra: str) -> tuple[dict[str, float], list[dict]]:
    """Grade the folder; each notebook's seconds (from the grader's progress lines) and rows."""
    seconds: dict[str, float] = {}
    proc = subprocess.Popen([sys.executable, "-m", "companion", "grade", str(folder), "--out",
                             str(out), "--jobs", str(jobs), "--source", str(REPO / "course"),
                             *extra], stdout=subprocess.PIPE, text=True, cwd=folder)
    for line in proc.stdout:
        if line.startswith("graded "):                 # graded PATH: got/top (N s)
            name = pathlib.Path(line.split(":")[0].removeprefix("graded ")).stem
            seconds[name] = float(line.rsplit("(", 1)[1].split()[0])
    proc.wait()
    return seconds, json.loads((out / "grades.json").read_text())


def compare(args) -> int:
    """Each learner notebook's grading time with the sandbox and without (`--trusted`), ABBA."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench-grading-"))
    os.chmod(folder, 0o755)
    for chapter in args.chapters:
        gn.save(gn.trimmed(chapter), folder / f"{chapter}_learner.ipynb")
    times: dict[str, dict[str, list[float]]] = {}
    for i, mode in enumerate(("sandbox", "trusted", "trusted", "sandbox")):
        extra = ["--trusted"] if mode == "trusted" else []
        seconds, rows = grade(folder, folder / f"grades{i}", args.jobs, *extra)
        for name, s in seconds.items():
            times.setdefault(name, {}).setdefault(mode, []).append(s)
        failed = [r for r in rows if not r["passed"]]
        for r in failed:
            print(f"    {mode}: {r['notebook']} {r['exercise']}: {r['status']}: {r['message'][:200]}")
    print("| notebook | with the sandbox, s | without (--trusted), s | ratio |")
    print("|---|---|---|---|")
    ratios = []
    for name in sorted(times):
        a, b = (sum(times[name][m]) / len(times[name][m]) for m in ("sandbox", "trusted"))
        ratios.append(a / b)
        print(f"| {name} | {a:.0f} | {b:.0f} | {a / b:.2f} |")
    print(f"\nsandbox cost: {statistics.median(ratios):.2f}x the time without it "
          f"(median over {len(ratios)} notebooks, each the mean of 2 runs per mode, ABBA)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--chapters", nargs="*", default=[f"{n:02d}" for n in range(14)])
    parser.add_argument("--compare", action="store_true",
                        help="grade with and without the kernel sandbox and compare the times")
    args = parser.parse_args()
    if args.compare:
        return compare(args)
    folder = pathlib.Path(tempfile.mkdtemp(prefix="bench-grading-"))
    os.chmod(folder, 0o755)
    for chapter in args.chapters:
        gn.save(gn.trimmed(chapter, verbatim=True), folder / f"{chapter}_course.ipynb")
        gn.save(gn.trimmed(chapter), folder / f"{chapter}_learner.ipynb")
    start = time.monotonic()
    seconds, rows = grade(folder, folder / "grades", args.jobs)
    print(f"graded {len(seconds)} notebooks in {time.monotonic() - start:.0f} s "
          f"(--jobs {args.jobs})\n")
    print("| chapter | exercises | copies caught (course) | passed (learner) | flags | course s "
          "| learner s |")
    print("|---|---|---|---|---|---|---|")
    bad = 0
    for chapter in args.chapters:
        mine = {kind: [r for r in rows if pathlib.Path(r["notebook"]).stem == f"{chapter}_{kind}"]
                for kind in ("course", "learner")}
        caught = sum(r["status"] == "reference" for r in mine["course"])
        passed = sum(r["passed"] for r in mine["learner"])
        flags = {f for r in mine["learner"] for f in r["flags"].split("; ")
                 if f.startswith("review")}
        n = len(mine["learner"])
        bad += (caught != len(mine["course"])) + (passed != n) + bool(flags)
        print(f"| {chapter} | {n} | {caught} | {passed} | "
              f"{', '.join(sorted(flags)) or 'none'} | {seconds.get(f'{chapter}_course', 0):.0f} | "
              f"{seconds.get(f'{chapter}_learner', 0):.0f} |")
        for r in mine["learner"] + [r for r in mine["course"] if r["status"] != "reference"]:
            if not r["passed"] or r in mine["course"]:
                print(f"    {r['notebook']} {r['exercise']}: {r['status']}: {r['message'][:300]}")
    print(f"\nfalse positives and copies missed: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
