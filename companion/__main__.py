"""The command line: ``python -m companion {workbook,reset,grade,execute,record,train,plan,explain} ...``."""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def _workbook(args) -> int:
    from companion.notebooks import make_workbooks

    report = make_workbooks(args.source, args.dest)
    for path in report["created"]:
        print(f"created {path}")
    for path in report["kept"]:
        print(f"kept    {path} (already there: your work is left as it is)")
    return 0


def _reset(args) -> int:
    from companion.notebooks import find_chapter, reset_workbook

    sources, errors = [], []
    for chapter in args.chapters:           # every argument checked before anything is moved
        try:
            sources.append(find_chapter(chapter, args.source))
        except ValueError as e:
            errors.append(str(e))
    if errors:
        print("\n".join(errors) + "\nnothing was reset", file=sys.stderr)
        return 2
    for chapter, src in zip(args.chapters, sources):
        existed = (args.dest / src.name).exists()
        backup, fresh = reset_workbook(chapter, args.source, args.dest)
        if backup is not None:
            print(f"moved   {fresh} -> {backup} (your old work, kept)")
        if backup is None and existed:
            print(f"kept    {fresh} (already fresh: no backup needed)")
        else:
            print(f"created {fresh} (fresh, exercises blank)")
    return 0


def _size(text: str) -> int:
    """'8GiB', '512 MiB', '2G', '0' (no cap) -> bytes."""
    units = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    number = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = number[-1:] if number[-1:] in units else ""
    try:
        return int(float(number.removesuffix(unit).strip()) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 8GiB)") from None


def _grade(args) -> int:
    sys.modules.setdefault("rfc3987_syntax", None)   # nbformat's jsonschema builds an IRI grammar
    # from it on import (3 s a process); the grader validates no IRIs
    from companion.grader.sandbox import harden_self
    from companion.grader.reports import printable
    from companion.grader.stopping import Stopped, stop_by_default
    from companion.grading import SetupError, format_table, grade, write_reports

    harden_self()         # a subreaper for what notebooks leave; not ptrace-able by them

    missing = [p for p in args.paths if not pathlib.Path(p).exists()]
    if missing:
        print(f"no such notebook: {', '.join(printable(p) for p in missing)}", file=sys.stderr)
        return 2

    def progress(path, rows, seconds):
        path = printable(path)                  # a file name cannot drive the terminal
        got, top = sum(r.points for r in rows), sum(r.max_points for r in rows)
        if seconds is None:
            print(f"kept {path} from the earlier run: {got}/{top}", flush=True)
        else:
            print(f"graded {path}: {got}/{top} ({seconds:.0f} s)", flush=True)

    try:
        rows = grade(args.paths, cell_timeout=args.cell_timeout,
                     exercise_timeout=args.exercise_timeout,
                     notebook_timeout=args.notebook_timeout, memory=args.memory,
                     output=args.output_cap, jobs=args.jobs, source=args.source,
                     run_as=args.run_as, out=args.out, progress=progress, resume=args.resume,
                     trusted=args.trusted, disk=args.disk, hide=args.hide)
    except SetupError as e:
        print(f"cannot grade: {e}", file=sys.stderr)
        return 2
    except Stopped as stopped:      # the grader's copies are removed; the reports hold what ended
        print(f"grading {stopped}: {args.out} holds the notebooks finished (--resume carries on)",
              file=sys.stderr, flush=True)
        stop_by_default(stopped)
    json_path, csv_path = write_reports(rows, args.out)
    print(format_table(rows))
    print(f"wrote {json_path} and {csv_path}; their SHA-256 (also in {args.out / 'grades.sha256'}, "
          "check with sha256sum -c):")
    print((args.out / "grades.sha256").read_text(), end="")
    return 0


def _execute(args) -> int:
    from companion.notebooks import execute

    for path in args.paths:
        print(f"executing {path}", flush=True)
        execute(path, timeout=args.cell_timeout)
    return 0


def _record(args) -> int:
    import torch

    from companion.record.runner import CHAPTERS, record
    from companion.record.smoke import smoke

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: this PyTorch sees no CUDA device (torch.cuda.is_available() is "
              "False); install a CUDA build of PyTorch, or pass --device cpu", file=sys.stderr)
        return 2
    unknown = [c for c in args.chapters or [] if c not in CHAPTERS]
    if unknown:
        print(f"no recorded experiment for chapter(s) {', '.join(unknown)}; choose from "
              f"{' '.join(CHAPTERS)}", file=sys.stderr)
        return 2
    if args.session:
        if device.type == "cpu" and args.out is None:
            print("a session on the CPU is a dry run at the smoke sizes: pass --out FOLDER for its "
                  "results file (course/results holds GPU runs only)", file=sys.stderr)
            return 2
        from companion.record.session import session
        summary = session(device, budget_seconds=args.budget_seconds, out=args.out,
                          chapters=args.chapters)
        print(summary.table())
        return 1 if summary.failed else 0
    if args.smoke:
        rows = smoke(device, chapters=args.chapters)
        failed = [name for name, passed, _, _ in rows if not passed]
        print(f"smoke on {device}: {len(rows) - len(failed)} of {len(rows)} passed in "
              f"{sum(r[2] for r in rows):.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed
                                                    else ""))
        return 1 if failed else 0
    if device.type == "cpu" and args.out is None:
        print("--device cpu runs the recorder at CPU sizes, to test it; course/results holds GPU "
              "runs only. Pass --out FOLDER for the CPU run's file.", file=sys.stderr)
        return 2
    path, failed = record(args.chapters, device=device, out=args.out)
    for chapter, error in failed.items():
        print(f"chapter {chapter} FAILED (not written): {error}", file=sys.stderr)
    print(f"wrote {path}" if path.exists() else "nothing recorded")
    return 1 if failed else 0


def _explain(args) -> int:
    import json

    from companion.explain import explain_file, format_explanation

    try:
        found = explain_file(args.snapshot, device=args.device)
    except (OSError, ValueError) as e:      # explain_file turns any unreadable file into these
        print(f"companion explain: {args.snapshot}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(found, indent=1) if args.json else format_explanation(found))
    return 0


def _train(args) -> int:
    from companion.train import main as train_main

    return train_main(args.options)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m companion", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("workbook", help="create the learner's workbooks that are missing")
    p.add_argument("--source", default=REPO / "course", type=pathlib.Path)
    p.add_argument("--dest", default=REPO / "workbook", type=pathlib.Path)
    p.set_defaults(run=_workbook)

    p = sub.add_parser("reset", help="a fresh workbook for chapters; the old ones go to backups/")
    p.add_argument("chapters", nargs="+", help="chapter numbers, e.g. 01 04")
    p.add_argument("--source", default=REPO / "course", type=pathlib.Path)
    p.add_argument("--dest", default=REPO / "workbook", type=pathlib.Path)
    p.set_defaults(run=_reset)

    p = sub.add_parser("grade", help="grade notebooks; write grades.json and grades.csv",
                       description="Grade notebooks in sandboxes; see docs/GRADING.md.")
    p.add_argument("paths", nargs="+", type=pathlib.Path, help="notebooks, or folders of them")
    p.add_argument("--out", default=pathlib.Path("grades"), type=pathlib.Path)
    p.add_argument("--source", default=REPO / "course", type=pathlib.Path,
                   help="the course's source notebooks, with solutions (default course/)")
    p.add_argument("--jobs", default=1, type=int, help="notebooks graded at once (default 1)")
    p.add_argument("--cell-timeout", default=120, type=float, help="seconds per cell (default 120)")
    p.add_argument("--exercise-timeout", default=60, type=float,
                   help="seconds at least for each exercise's check (default 60)")
    p.add_argument("--notebook-timeout", default=1800, type=float,
                   help="seconds per notebook, all included (default 1800)")
    p.add_argument("--memory", default=None, type=_size,
                   help="address-space cap of each notebook's process (default 8GiB, none where "
                        "CUDA is available; 0: none)")
    p.add_argument("--output-cap", default="1MiB", type=_size,
                   help="printed output kept per notebook (default 1MiB)")
    p.add_argument("--run-as", default="auto",
                   help="user the notebooks run as: auto (nobody when root), self, or a name")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of notebooks a stopped run in --out finished (files "
                        "unchanged) and grade the rest")
    p.add_argument("--disk", default="2GiB", type=_size,
                   help="each sandbox's private temporary space, in memory (default 2GiB)")
    p.add_argument("--hide", action="append", default=[], type=pathlib.Path, metavar="DIR",
                   help="a folder the notebooks must not see, e.g. another copy of the course "
                        "(repeatable)")
    p.add_argument("--trusted", action="store_true",
                   help="grade without the bubblewrap sandbox (the notebooks are then not "
                        "isolated by the kernel: only for code you trust, or in a container)")
    p.set_defaults(run=_grade)

    p = sub.add_parser("execute", help="run source notebooks and save them with outputs")
    p.add_argument("paths", nargs="+", type=pathlib.Path)
    p.add_argument("--cell-timeout", default=600, type=int)
    p.set_defaults(run=_execute)

    p = sub.add_parser("record", help="run every chapter's experiment at the device's sizes and "
                                      "write <out>/<machine>.json (course/results on a GPU)")
    p.add_argument("--chapters", nargs="+", metavar="NN", help="e.g. 00 04 (default: all)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="default: cuda when available, else cpu (CPU sizes, to test the recorder)")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="folder of the results file (default course/results; required on cpu)")
    p.add_argument("--smoke", action="store_true",
                   help="check in about a minute that every device code path runs; writes nothing")
    p.add_argument("--session", action="store_true",
                   help="the whole GPU session: smoke check, GPU tests, every chapter, within "
                        "--budget-seconds (on cpu: a dry run at the smoke sizes)")
    p.add_argument("--budget-seconds", type=float, default=540.0,
                   help="the session's wall-clock budget (default 540)")
    p.set_defaults(run=_record)

    from companion.plan.cli import add_parser as add_plan
    add_plan(sub)

    p = sub.add_parser("explain", help="what a CUDA memory snapshot held at its peak, by kind, "
                                       "and the cheapest levers")
    p.add_argument("snapshot", type=pathlib.Path,
                   help="a pickle from torch.cuda.memory._dump_snapshot, read as plain data (a "
                        "file that holds code is refused, never run)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_explain)

    p = sub.add_parser("train", add_help=False,
                       help="train the course GPT with chosen techniques (under torchrun: "
                            "torchrun --nproc_per_node=2 -m companion train --help)")
    p.set_defaults(run=_train)

    args, args.options = parser.parse_known_args(argv)    # train's options: its own parser
    if args.options and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(args.options)}")
    try:
        return args.run(args)
    except BrokenPipeError:              # `... | head`: the reader left; no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
