"""Each check run on each mutant of its exercise, under fixed seeds.

A mutant is killed when its check fails under one of `SEEDS` (it stops at the first), when its
cell raises, or when it runs past the time limit (the check reports that as a failure). It
survives when the check passes under every seed. A survivor listed in `equivalent.toml` (the
reviewed table: a mutant that computes what the reference computes, with the reason) counts as
equivalent, not as a survivor; nothing is declared equivalent automatically. `probe` more seeds
tell a survivor that passes by the luck of a draw (a check whose cases do not always discriminate)
from one that passes every draw (a check with no case for it, or an equivalent mutant).
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
import tomllib
import warnings

from companion.checks.core import REGISTRY, CheckFailed, GraderError, evaluate, seeded

from .exercises import Chapter, Target
from .mutate import KINDS, Mutant, mutants

__all__ = ["SEEDS", "Outcome", "Report", "run_target", "select", "equivalent_table"]

SEEDS = (0, 1, 2)
TABLE = pathlib.Path(__file__).with_name("equivalent.toml")


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    verdict: str              # "killed", "survived" or "equivalent"
    how: str                  # which seed killed it and the check's first line, or why equivalent
    seconds: float


@dataclasses.dataclass
class Report:
    target: Target
    found: int = 0            # mutants of the solution
    outcomes: list[Outcome] = dataclasses.field(default_factory=list)
    reference_seconds: float = 0.0
    limit: float = 0.0        # the time limit each mutant's check ran under
    skip: str = ""            # why no mutant ran
    selected: int = 0         # mutants chosen to run (at most the cap)
    unrun: int = 0            # of those, left out when the exercise's time budget was spent

    def count(self, verdict: str) -> int:
        return sum(o.verdict == verdict for o in self.outcomes)


def equivalent_table(path: pathlib.Path = TABLE) -> dict[tuple[str, str, str], str]:
    """(check, the line's code, the change) -> why that mutant is equivalent."""
    entries = tomllib.loads(path.read_text()).get("mutant", []) if path.exists() else []
    table = {}
    for entry in entries:
        if not entry.get("why", "").strip():
            raise ValueError(f"{path}: the entry for {entry.get('check')} {entry.get('change')} "
                             "gives no reason (why = ...)")
        table[entry["check"], entry["code"], entry["change"]] = entry["why"]
    return table


def key(mutant: Mutant) -> tuple[str, str]:
    """A mutant as the table names it: the line's code and the change, not the line's number
    (which moves when a line above it is edited)."""
    return mutant.code, f"{mutant.kind}: {mutant.change}"


def select(found: list[Mutant], cap: int | None) -> list[Mutant]:
    """At most `cap` mutants, the same every run: one of each kind in turn (in source order within
    a kind), so a cap keeps every kind of mistake the solution admits."""
    if cap is None or len(found) <= cap:
        return found
    queues = {kind: [m for m in found if m.kind == kind] for kind in KINDS}
    chosen: list[Mutant] = []
    while len(chosen) < cap:
        for kind in KINDS:
            if queues[kind] and len(chosen) < cap:
                chosen.append(queues[kind].pop(0))
    return sorted(chosen, key=lambda m: (m.line, KINDS.index(m.kind)))


def _verdict(chapter: Chapter, target: Target, source: str, seeds, limit: float) -> tuple[str, str]:
    """("killed", how) or ("passed", "") for one answer under `seeds`, stopping at the first fail."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            answer = chapter.answer(target, source)
    except Exception as e:
        return "killed", f"its cell raises {type(e).__name__}: {str(e)[:80]}"
    for seed in seeds:
        try:
            with seeded(seed):
                evaluate(target.check, answer, timeout=limit)
        except CheckFailed as failure:
            return "killed", f"seed {seed}: {str(failure).splitlines()[0][:110]}"
        except GraderError as e:
            return "killed", f"seed {seed}: the check cannot run it ({e})"
    return "passed", ""


def run_target(chapter: Chapter, target: Target, *, cap: int | None = None, probe: int = 0,
               table: dict | None = None, seeds=SEEDS, budget: float | None = None) -> Report:
    """Run `target`'s check on the reference, then on each of its mutants (at most `cap`, and
    none started after `budget` seconds: the rest are counted in `unrun`)."""
    table = equivalent_table() if table is None else table
    report = Report(target)
    if target.skip:
        report.skip = target.skip
        return report
    found = mutants(target.code, target.lines)
    report.found = len(found)
    info = REGISTRY[target.check]
    slowest = 0.0
    for seed in seeds:
        start = time.perf_counter()
        verdict, how = _verdict(chapter, target, target.code, [seed], info.timeout)
        slowest = max(slowest, time.perf_counter() - start)
        report.reference_seconds += time.perf_counter() - start
        if verdict != "passed":
            report.skip = f"the reference fails its check: {how}"
            return report
    # a mutant that loops forever costs the limit: the check's own, or 4 times the reference's
    # slowest seed when that is shorter (and at least 10 s)
    report.limit = round(min(info.timeout, max(10.0, 4 * slowest)), 1)
    chosen = select(found, cap)
    report.selected, began = len(chosen), time.perf_counter()
    try:
        for done, mutant in enumerate(chosen):
            if budget is not None and time.perf_counter() - began > budget:
                report.unrun = len(chosen) - done
                break
            start = time.perf_counter()
            verdict, how = _verdict(chapter, target, mutant.source, seeds, report.limit)
            if verdict == "passed":
                why = table.get((target.check, *key(mutant)))
                if why:
                    verdict, how = "equivalent", why
                else:
                    verdict, how = "survived", _probe(chapter, target, mutant, probe, seeds,
                                                      report.limit)
            report.outcomes.append(Outcome(mutant, verdict, how,
                                           time.perf_counter() - start))
    finally:
        chapter.restore(target)
    return report


def _probe(chapter: Chapter, target: Target, mutant: Mutant, probe: int, seeds,
           limit: float) -> str:
    """How a survivor fares on `probe` more seeds: "passes 3 seeds" (+ "and 10 more" or
    "; fails under seed 7 of 10 more": a check that catches it only on some draws)."""
    if not probe:
        return f"passes {len(seeds)} seeds"
    more = range(max(seeds) + 1, max(seeds) + 1 + probe)
    failed = [s for s in more if _verdict(chapter, target, mutant.source, [s], limit)[0]
              == "killed"]
    if not failed:
        return f"passes {len(seeds)} seeds and {probe} more"
    return (f"passes {len(seeds)} seeds; fails {len(failed)} of {probe} more "
            f"(first: seed {failed[0]}): a lucky-draw pass")
