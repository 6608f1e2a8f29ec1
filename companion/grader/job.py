"""Grade one notebook in a process of its own (started by `batch`, one per notebook).

    python -I -c "$BOOT" < spec.json          (see `boot`; one JSON event per line on stdout)

It reads the submission and its source chapter, plans the steps, runs the cells in a sandbox
(`session.Session`), and runs every expected check here, in a process that runs no learner code,
on a `SandboxAnswer`; an answer that passes is graded again in a clean room (`cleanroom`), which
decides whether it used a reference. If the sandbox dies or hangs, it is started again and the
cells run so far are replayed (the one that killed it is skipped), so one exercise cannot cost the
others. Events:
"expected" (the rows it will fill), "row" (one exercise done), "done" (notebook-level flags).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys

import nbformat

from companion.checks.core import REGISTRY, CheckFailed, GraderError, NotDone, evaluate
from companion.grader import cleanroom
from companion.grader.answer import SandboxAnswer
from companion.grader.copies import copied_solutions
from companion.grader.expected import Chapter, Exercise, match_chapter, make_plan, read_chapter
from companion.grader.sandbox import ChildLost, Limits, harden_self
from companion.grader.session import Session, confinement
from companion.grader.stopping import Stopped, die_with_parent, on_signals, stop_by_default
from companion.grader.submission import MAX_NOTEBOOK, read_submission
from companion.grader.scan import learner_cells, reference_uses, review_flags
from companion.grader.withhold import verified_files

__all__ = ["grade_notebook", "main"]


def _row(spec: dict, ex: Exercise, status: str, message: str, *, points: int = 0) -> dict:
    return {"notebook": spec["label"], "exercise": ex.name, "passed": status == "passed",
            "points": points, "max_points": ex.points, "message": message, "status": status}


# ---------------------------------------------------------------- one exercise

def _grade_exercise(session: Session, spec: dict, nb, ex: Exercise, *,
                    alone: bool) -> tuple[dict, bool]:
    """The exercise's row, and whether it still has to pass in a clean room (run by `_run_plan`
    once the notebook's own sandbox has ended)."""
    uses = reference_uses(nb, ex)
    if uses:
        return _row(spec, ex, "reference", f"uses the reference for this exercise: {uses[0]}; "
                                           "write it yourself"), False
    status, message, hits = _evaluate(session, ex)
    if hits:
        name, n = next(iter(hits.items()))
        return _row(spec, ex, "reference", f"calls {name} ({n} time{'s' if n > 1 else ''}), the "
                                           "reference for this exercise: write it yourself"), False
    pending = status == "passed" and bool(ex.references) and alone
    return _row(spec, ex, status, message, points=ex.points if status == "passed" else 0), pending


def _evaluate(session: Session, ex: Exercise) -> tuple[str, str, dict]:
    """Run the exercise's check on the answer in `session`: (status, message, reference calls
    the sandbox counted)."""
    if not session.ensure():
        return "not graded", session.why_stopped(), {}
    try:
        reply = session.child.request({"op": "resolve", "name": ex.answer}, timeout=30.0)
    except ChildLost as lost:
        session.lose(lost)
        return "not graded", f"the notebook's process was lost: {lost.reason}", {}
    if reply.get("kind") == "missing":
        return "failed", f"the notebook defines no `{ex.answer}`: keep the name the workbook " \
                         "gives the answer", {}
    answer = (SandboxAnswer(ex.answer, session, ex.references) if reply.get("kind") == "callable"
              else reply.get("value"))
    timeout = min(max(ex.timeout, session.limits.exercise), max(session.left(), 1.0))
    try:
        message, status = evaluate(ex.check, answer, timeout=timeout), "passed"
    except NotDone as e:
        message, status = e.summary, "not done"
    except CheckFailed as e:
        message, status = str(e).removeprefix(f"{ex.check}: "), "failed"
    except GraderError as e:
        message, status = f"the grader cannot run this check in its sandbox: {e}", "ungradable"
    return status, message, getattr(answer, "hits", {})


def _alone(session: Session, spec: dict, ex: Exercise, passed: str) -> tuple[str, str]:
    """The verdict of the clean room (see `cleanroom`) on an answer that passed in the notebook."""
    needed = cleanroom.needed_sources(list(session.history), ex.answer)
    try:
        files = _package_files(spec)
    except ValueError as e:
        return "tampered", f"the grader's copy of the package changed while this notebook ran: {e}"
    results = pathlib.Path(spec["results"]) if spec.get("results") else None
    root, modules, outside = cleanroom.build_package(files, ex.references, results)
    path = [str(root)] + [p for p in session.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    room = Session(spec, session.limits, session.modules,
                   env=dict(session.env, PYTHONPATH=os.pathsep.join(path)),
                   user=tuple(spec["clean_user"]) if spec.get("clean_user") else None,
                   withheld={"preload": modules, "outside": outside},
                   confine=_clean_confinement(spec, root))
    room.deadline = session.deadline
    try:          # the notebook's own sandbox has ended, and every process it started with it
        errors = [room.run_cell(source) for source in needed]
        status, message, _ = _evaluate(room, ex)
    finally:
        room.close()
        shutil.rmtree(root, ignore_errors=True)
    if status == "passed":
        return status, passed
    name = next(filter(None, map(cleanroom.withheld_name, [message, *errors])), "")
    if name:
        return "reference", f"uses {name}, which this exercise withholds: graded on its own " \
                            "(a fresh interpreter without it), the answer could not run; write " \
                            "it yourself"
    if room.ran_as is None:                # the grader's fault, not the learner's
        return "ungradable", f"the grader could not start the fresh interpreter it grades this " \
                             f"answer in a second time: {message}"
    if status == "not graded":
        return status, f"graded on its own, in a fresh interpreter: {message}"
    return "failed", f"passes in the notebook but not on its own (a fresh interpreter that runs " \
                     f"the notebook's imports and the definitions `{ex.answer}` uses): {message}"


def _clean_confinement(spec: dict, root: pathlib.Path):
    """The clean room's filesystem: the first run's, with the package's own folders empty (its
    withheld copy, `root`, bound in their place), so the references are absent, not hidden."""
    base = confinement(spec)
    if base is None:
        return None
    shown = [str(root)] + ([spec["results"]] if spec.get("results") else [])
    return base.with_(hide=spec.get("package_dirs", ()), show=shown)


_FILES: dict[str, bytes] = {}


def _package_files(spec: dict) -> dict[str, bytes]:
    """The grader's copy of the package, each file checked against the digest the batch took
    before any notebook ran (ValueError if one differs)."""
    if not _FILES:
        digests = {k: v for k, v in spec["digests"].items() if k.startswith("companion/")}
        _FILES.update(verified_files(pathlib.Path(spec["private"]), digests))
    return _FILES


# ---------------------------------------------------------------- one notebook

def _read(path: str, max_bytes: int):
    """The submission as a notebook, or ValueError saying why it is not one (`read_submission`:
    a regular file only, no symlink followed, at most max_bytes read)."""
    data = read_submission(path, max_bytes)
    if not data:
        raise ValueError("the file is empty")
    try:
        nb = nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception as e:
        raise ValueError(f"not a readable notebook ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(nb.get("cells"), list):
        raise ValueError("not a notebook: it has no cells")
    return nb


def grade_notebook(spec: dict, emit) -> None:
    """Grade spec["notebook"]; report with emit(event, **data)."""
    try:
        nb = _read(spec["notebook"], spec.get("max_bytes", MAX_NOTEBOOK))
    except (ValueError, OSError) as e:
        named = [Chapter(pathlib.Path(p), [], set()) for p in spec["chapters"]]
        emit("unreadable", reason=str(e), chapter=_chapter_name(
            match_chapter(nbformat.v4.new_notebook(), spec["notebook"], named)))
        return
    chapters = [read_chapter(p) for p in spec["chapters"]]
    chapter = match_chapter(nb, spec["notebook"], chapters)
    if chapter is None:
        emit("unreadable", reason="none of its cells comes from a course notebook and its file "
                                  "name names no chapter", chapter="")
        return
    if chapter.error:
        emit("unreadable", reason=f"the grader cannot grade {chapter.path.name}: {chapter.error}",
             chapter="", status="ungradable")
        return
    emit("expected", chapter=_chapter_name(chapter))
    _run_plan(spec, nb, chapter, emit)


def _chapter_name(chapter: Chapter | None) -> str:
    return chapter.path.name if chapter else ""


def _run_plan(spec: dict, nb, chapter: Chapter, emit) -> None:
    limits = Limits(**spec["limits"])
    modules = tuple(sorted({REGISTRY[ex.check].module for ex in chapter.exercises}))
    plan, session, done = make_plan(nb, chapter), Session(spec, limits, modules), set()
    source = nbformat.read(chapter.path, as_version=4)
    written = learner_cells(nb, source)     # none: every cell is the course's own code, whose
    alone = bool(written) and bool(spec.get("digests"))   # answers need no second run
    copies = copied_solutions(nb, source, chapter)        # the course's solutions: `reference`
    for ex in chapter.exercises:
        if ex.check in plan.tampered:
            emit("row", row=_row(spec, ex, "tampered", plan.tampered[ex.check]))
            done.add(ex.check)
    cell_errors: dict[int, str] = {}
    later: list[tuple[Exercise, dict]] = []       # passed, to be graded on their own
    try:
        for step in plan.steps:
            if step.kind == "exec":
                error = session.run_cell(step.source)
                cell_errors[step.cell] = cell_errors.get(step.cell) or error
                continue
            ex = step.exercise
            if ex.check in done:
                continue
            done.add(ex.check)
            pending = False
            if ex.check in copies:
                row = _row(spec, ex, "reference", copies[ex.check])
            elif cell_errors.get(step.cell):
                row = _row(spec, ex, "failed", "not run: its cell stopped before the check line: "
                                               f"{cell_errors[step.cell]}")
            else:
                row, pending = _grade_exercise(session, spec, nb, ex, alone=alone)
            row["message"] += "".join(f" ({note})" for note in plan.notes.get(ex.check, []))
            if pending:
                later.append((ex, row))
            else:
                emit("row", row=row)
    finally:
        session.close()
    # Clean rooms only now: a process of the first run, paused or not, could otherwise hold
    # the reference out to them through anything the kernel shares (a file lock, a keyring).
    for ex, row in later:
        status, message = _alone(session, spec, ex, row["message"])
        emit("row", row=_row(spec, ex, status, message,
                             points=ex.points if status == "passed" else 0))
    for ex in chapter.exercises:
        if ex.check not in done:
            emit("row", row=_row(spec, ex, "not graded", session.why_stopped()))
    emit("done", flags=_flags(written, session), ran_as=session.ran_as)


def _flags(written: list, session: Session) -> list[str]:
    flags = [f"review: {why}" for why in review_flags(written)]
    if session.output_total > session.limits.output:
        flags.append(f"printed {session.output_total / 2**20:.1f} MiB; the grader kept "
                     f"{session.limits.output / 2**20:.1f} MiB")
    if session.losses:
        flags.append(f"its process was lost {len(session.losses)} time(s) and restarted: "
                     + "; ".join(session.losses[:3]))
    return flags


def _cap_memory(limit: int) -> None:
    """A soft address-space cap on this process (its sandboxes lift it for themselves)."""
    if limit:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def main(spec: dict | None = None) -> int:
    spec = json.loads(sys.stdin.read()) if spec is None else spec
    harden_self()
    _cap_memory(spec["limits"].get("grader_memory", 0))
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                      # anything else printed goes to stderr, not to the events

    def emit(event: str, **data) -> None:
        out.write(json.dumps({"event": event, **data}) + "\n")

    try:
        with on_signals():             # SIGTERM from the batch: clean rooms and sandboxes removed
            die_with_parent(spec.get("batch"))           # SIGTERM too when the batch is killed
            grade_notebook(spec, emit)
    except Stopped as stopped:
        stop_by_default(stopped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
