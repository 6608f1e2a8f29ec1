"""Mutation testing of every exercise check: does each check fail the mistakes a learner makes?

    python benchmarks/bench_mutants.py [--chapter 01 ...] [--check NAME ...] [--sample K]
                                       [--cap N] [--budget S] [--probe P]

For each exercise, mutants of its reference solution (`tests/mutants/mutate.py`: an operator
swapped, a bound off by one, a term, argument, call or dtype changed, an early return, ...) run in
the namespace the notebook gives the exercise (`tests/mutants/exercises.py`), and its check runs on
each under the seeds 0, 1 and 2 (`companion.checks.core.seeded`), stopping at the first that fails.
Per check it prints the mutants found and run, killed, equivalent (the reviewed table
`tests/mutants/equivalent.toml`) and the survivors with their description: each survivor is a
mistake the check lets through, a hole to fix (or, after review, an equivalent to list).

`--cap N` runs at most N mutants per exercise (one of each kind in turn, the same every run;
default 0: all); `--sample K` at most K (for a quick look); `--budget S` starts no mutant of an
exercise after S seconds (default 900, a guard against a check made slow: with it every
mutant of every exercise runs, all chapters within 40 minutes of a 2-core machine; the report
says how many were left out); `--probe P` runs each survivor under P more seeds, to tell a pass by a lucky draw
from one on every draw (default 3). A mutant's check
runs under the check's own time limit, or 4 times the reference's slowest run when that is
shorter (at least 10 s): a mutant that loops forever costs that much.
It ends with the line `N survivors of M non-equivalent mutants (E equivalent)`.
Not a test: it runs for many minutes; tests/test_mutants.py runs a fixed sample.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from mutants import Chapter, chapters, equivalent_table, run_target  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapter", nargs="*", default=None, help="chapters, e.g. 01 04")
    parser.add_argument("--check", nargs="*", default=None, help="check names, e.g. check_merge")
    parser.add_argument("--cap", type=int, default=0, help="mutants per exercise at most (0: all)")
    parser.add_argument("--sample", type=int, default=None, help="mutants per exercise, for CI")
    parser.add_argument("--probe", type=int, default=3, help="more seeds for each survivor")
    parser.add_argument("--budget", type=float, default=900.0,
                        help="seconds per exercise after which no mutant starts (0: none)")
    args = parser.parse_args(argv)
    known = chapters()
    wanted = args.chapter or known
    bad = [c for c in wanted if c not in known]
    if bad:
        parser.error(f"no chapter {', '.join(bad)}: the chapters are {' '.join(known)}")
    cap = args.sample if args.sample is not None else (args.cap or None)
    table = equivalent_table()
    totals = {"survived": 0, "killed": 0, "equivalent": 0}
    seen_checks, rows, start_all = set(), [], time.perf_counter()
    for number in wanted:
        with Chapter(number) as chapter:
            seen_checks |= {t.check for t in chapter.targets}
            rows += _run_chapter(chapter, args, cap, table, totals)
    missing = [c for c in args.check or [] if c not in seen_checks]
    if missing:
        parser.error(f"no exercise is checked by {', '.join(missing)} in chapters "
                     f"{' '.join(wanted)}")
    print(f"\n| chapter | check | mutants | run | killed | equivalent | survivors | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for number, check, found, ran, killed, equal, alive, note, seconds in rows:
        cells = f"{ran} | {killed} | {equal} | {alive}" if not note else f"{note} | | |"
        print(f"| {number} | {check} | {found} | {cells} | {seconds:.0f} |")
    print(f"\ntotal {time.perf_counter() - start_all:.0f} s")
    non_equivalent = totals["killed"] + totals["survived"]
    print(f"{totals['survived']} survivors of {non_equivalent} non-equivalent mutants "
          f"({totals['equivalent']} equivalent)")
    return 0


def _run_chapter(chapter: Chapter, args, cap: int | None, table: dict, totals: dict) -> list:
    """Run the chapter's selected exercises; print each report; return the table's rows."""
    number, rows = chapter.number, []
    targets = [t for t in chapter.targets if not args.check or t.check in args.check]
    if not targets:
        return rows
    print(f"chapter {number}: namespace built in {chapter.built_in:.1f} s"
          + "".join(f"\n  note: {n}" for n in chapter.notes), flush=True)
    for target in targets:
        start = time.perf_counter()
        report = run_target(chapter, target, cap=cap, probe=args.probe, table=table,
                            budget=args.budget or None)
        seconds = time.perf_counter() - start
        if report.skip:
            print(f"  {target.check}: not run: {report.skip}", flush=True)
            rows.append((number, target.check, report.found, 0, 0, 0, 0, "not run", seconds))
            continue
        killed, equal, alive = (report.count(v) for v in ("killed", "equivalent", "survived"))
        totals["killed"] += killed
        totals["equivalent"] += equal
        totals["survived"] += alive
        ran = len(report.outcomes)
        unrun = (f"; {report.unrun} more not run: the budget of {args.budget:g} s was spent"
                 if report.unrun else "")
        print(f"  {target.check}: {report.found} mutants, {ran} run, {killed} killed, "
              f"{equal} equivalent, {alive} survivors ({seconds:.1f} s; reference "
              f"{report.reference_seconds:.1f} s for 3 seeds, limit {report.limit:g} s"
              f"{unrun})", flush=True)
        for outcome in report.outcomes:
            if outcome.verdict != "killed":
                m = outcome.mutant
                print(f"    {outcome.verdict}: line {m.line} `{m.code}`: {m.kind}: "
                      f"{m.change} -- {outcome.how}", flush=True)
        rows.append((number, target.check, report.found, ran, killed, equal, alive, "",
                     seconds))
    return rows


if __name__ == "__main__":
    sys.exit(main())
