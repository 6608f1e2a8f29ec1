"""A learner's sitting, measured: every chapter's workbook run to its end in a real kernel, two at a
time, with the kernel's default threads.

    python benchmarks/bench_chapters.py                  # all chapters' workbooks, two at once
    python benchmarks/bench_chapters.py --chapters 10 11 --jobs 1
    python benchmarks/bench_chapters.py --source         # the solved notebooks instead

Each chapter runs in its own process through nbclient (as "Run All" in JupyterLab: exercises not
written yet show their notice and the notebook runs on), in a folder of fresh workbooks made as
`tasks.py lab` makes them. OMP_NUM_THREADS is removed from the kernels' environment: a JupyterLab
kernel does not inherit `tasks.py test`'s one thread, so the threads are what the chapter's first
cell (`companion.session.start`) chooses. The goals: every cell within 60 s and every chapter
within 5 minutes on a 2-core machine while another chapter runs beside it.

It prints a table per chapter (wall time, whether it reached its end, error outputs, the slowest
cells) and ends with one line: how many chapters and cells are within the goals. A benchmark, not
a test: nothing asserts on time.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CELL_GOAL, CHAPTER_GOAL = 60.0, 300.0


def run_one(path: pathlib.Path, timeout: int) -> dict:
    """Execute one notebook in a kernel started in its folder; each cell's wall time (from the
    moment the client sends it to the moment its reply and output are in: what a learner waits),
    the kernel's start, and the errors."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    began, seconds = time.perf_counter(), {}
    first = []

    def on_start(cell, cell_index, **_):
        first.append(time.perf_counter()) if not first else None
        seconds[cell_index] = -time.perf_counter()

    def on_done(cell, cell_index, **_):
        seconds[cell_index] += time.perf_counter()

    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                                     resources={"metadata": {"path": str(path.parent)}},
                                     on_cell_start=on_start, on_cell_executed=on_done)
    stopped = None
    try:
        client.execute()
    except Exception as e:                                  # a cell past its timeout, a dead kernel
        stopped = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    wall = time.perf_counter() - began
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    errors = [i for i in code for o in nb.cells[i].get("outputs", [])
              if o.get("output_type") == "error"]
    ran = [i for i in code if nb.cells[i].get("execution_count") is not None]
    return {"chapter": path.stem, "wall": wall, "stopped": stopped, "errors": errors,
            "reached_end": stopped is None and bool(code) and ran[-1:] == code[-1:],
            "startup": (first[0] - began) if first else wall,
            "cells": [(i, s) for i, s in seconds.items() if s > 0]}


def _run_in_process(path: pathlib.Path, timeout: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, __file__, "--one", str(path), "--timeout", str(timeout)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"chapter": path.stem, "wall": float("nan"), "stopped": "the runner failed: "
                + (done.stderr.strip().splitlines() or ["no output"])[-1][:200],
                "errors": [], "reached_end": False, "cells": [], "startup": float("nan")}


def _workbooks(chapters: list[str], source: bool, folder: pathlib.Path) -> list[pathlib.Path]:
    from companion.notebooks import make_workbooks

    course = ROOT / "course"
    if source:
        paths = sorted(course.glob("[0-9][0-9]_*.ipynb"))
        for p in paths:
            (folder / p.name).write_bytes(p.read_bytes())
    else:
        make_workbooks(course, folder)
    return sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb")
                  if not chapters or p.name[:2] in chapters)


def report(results: list[dict]) -> str:
    lines = [f"{'chapter':28} {'wall':>8} {'start':>6} {'end':>4} {'errors':>7}  "
             "slowest cells (index: seconds)"]
    for r in sorted(results, key=lambda r: r["chapter"]):
        slow = sorted(r["cells"], key=lambda c: -c[1])[:4]
        flag = " <- over 5 min" if r["wall"] > CHAPTER_GOAL else ""
        lines.append(f"{r['chapter']:28} {r['wall']:7.0f}s {r['startup']:5.0f}s "
                     f"{'yes' if r['reached_end'] else 'NO':>4} "
                     f"{len(r['errors']):>7}  " + ", ".join(
                         f"[{i}] {s:.0f}s" + (" (over 60 s)" if s > CELL_GOAL else "")
                         for i, s in slow) + flag)
        if r["stopped"]:
            lines.append(f"{'':28} stopped: {r['stopped']}")
    over_cells = sum(s > CELL_GOAL for r in results for _, s in r["cells"])
    within = sum(r["reached_end"] and r["wall"] <= CHAPTER_GOAL
                 and all(s <= CELL_GOAL for _, s in r["cells"]) for r in results)
    lines.append(f"{within} of {len(results)} chapters reached their end within 5 minutes with "
                 f"every cell within 60 s; {over_cells} cells over 60 s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapters", nargs="*", default=[], help="two-digit numbers (default all)")
    parser.add_argument("--jobs", type=int, default=2, help="chapters at once (default 2)")
    parser.add_argument("--source", action="store_true", help="the solved source notebooks")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(pathlib.Path(args.one), args.timeout)))
        return 0
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-chapters-") as tmp:
        paths = _workbooks(args.chapters, args.source, pathlib.Path(tmp))
        if not paths:
            parser.error(f"no chapter matches {args.chapters}")
        # The longest first, so the last ones to run are short (a pair, not one alone, to the end).
        paths.sort(key=lambda p: p.name[:2] not in ("11", "09", "05", "08", "10"))
        print(f"{len(paths)} {'notebooks' if args.source else 'workbooks'}, {args.jobs} at a time, "
              f"kernels with their default threads, on {os.cpu_count()} cores", flush=True)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(_run_in_process, p, args.timeout) for p in paths]
            results = []
            for f in concurrent.futures.as_completed(futures):
                results.append(f.result())
                r = results[-1]
                print(f"  {r['chapter']}: {r['wall']:.0f} s", flush=True)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
