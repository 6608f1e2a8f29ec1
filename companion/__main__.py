"""The command line: ``python -m companion {workbook,reset,grade,execute,train} ...``."""
from __future__ import annotations

import argparse
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
    from companion.notebooks import reset_workbook

    for chapter in args.chapters:
        try:
            backup, fresh = reset_workbook(chapter, args.source, args.dest)
        except ValueError as e:
            print(e, file=sys.stderr)
            return 2
        if backup is not None:
            print(f"moved   {fresh} -> {backup} (your old work, kept)")
        print(f"created {fresh} (fresh, exercises blank)")
    return 0


def _grade(args) -> int:
    from companion.grading import format_table, grade, write_reports

    missing = [p for p in args.paths if not pathlib.Path(p).is_file()]
    if missing:
        print(f"no such notebook: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    rows = grade(args.paths, cell_timeout=args.cell_timeout)
    json_path, csv_path = write_reports(rows, args.out)
    print(format_table(rows))
    print(f"wrote {json_path} and {csv_path}")
    return 0


def _execute(args) -> int:
    from companion.notebooks import execute

    for path in args.paths:
        print(f"executing {path}", flush=True)
        execute(path, timeout=args.cell_timeout)
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

    p = sub.add_parser("grade", help="grade notebooks; write grades.json and grades.csv")
    p.add_argument("paths", nargs="+", type=pathlib.Path)
    p.add_argument("--out", default=pathlib.Path("grades"), type=pathlib.Path)
    p.add_argument("--cell-timeout", default=60, type=int, help="seconds per cell (default 60)")
    p.set_defaults(run=_grade)

    p = sub.add_parser("execute", help="run source notebooks and save them with outputs")
    p.add_argument("paths", nargs="+", type=pathlib.Path)
    p.add_argument("--cell-timeout", default=600, type=int)
    p.set_defaults(run=_execute)

    p = sub.add_parser("train", add_help=False,
                       help="train the course GPT with chosen techniques (under torchrun: "
                            "torchrun --nproc_per_node=2 -m companion train --help)")
    p.set_defaults(run=_train)

    args, args.options = parser.parse_known_args(argv)    # train's options: its own parser
    if args.options and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(args.options)}")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
