"""Grade a batch: up to `jobs` notebooks at a time, each in a grading process of its own
(`companion.grader.job`, started through `boot.BOOT`), whose events become rows.

A grading process that dies (a notebook that kills it, a crash) costs only its own notebook: the
exercises it had not reported are "not graded", with the reason. After each notebook, processes
it left behind are ended (this process is their subreaper), the grader's private copy (and the
installed package, when the notebook ran with the grader's own permissions) is checked and put
back, and the reports and `grades.state.json` are rewritten, so that `--resume` can carry on
after a grader that was killed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import pwd
import selectors
import signal
import subprocess
import sys
import tempfile
import time

import nbformat

from companion.grader.boot import BOOT
from companion.grader.expected import Chapter, match_chapter
from companion.grader.integrity import Snapshot
from companion.grader.reports import Row, _atomic_write, printable, write_reports
from companion.grader.sandbox import children_of, end_descendants
from companion.grader.submission import digest as _digest, read_submission

__all__ = ["Batch", "sandbox_user", "slot_user", "clean_user", "child_env"]


@dataclasses.dataclass
class _Job:
    index: int
    path: pathlib.Path
    proc: subprocess.Popen
    started: float
    stderr: object
    slot: int
    user: tuple[int, int] | None
    buffer: bytes = b""
    events: list = dataclasses.field(default_factory=list)


def sandbox_user(run_as: str) -> tuple[int, int] | None:
    """(uid, gid) for the sandbox, or None to run it as this process's user."""
    if run_as == "self" or (run_as == "auto" and os.geteuid() != 0):
        return None
    entry = pwd.getpwnam("nobody" if run_as == "auto" else run_as)
    if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
        raise PermissionError(f"only root can run notebooks as {entry.pw_name!r}")
    return entry.pw_uid, entry.pw_gid


_SLOT_UIDS = 2_000_000_000      # unused uids: one per --jobs slot beyond the first (nobody)
_CLEAN_UIDS = 2_000_500_000     # and one per slot for its clean rooms (see grader.cleanroom)


def slot_user(user: tuple[int, int] | None, slot: int, *, spread: bool):
    """The user a job slot's sandbox runs as: notebooks graded at the same time as different
    users cannot signal each other's processes or write each other's files."""
    if user is None or not spread or slot == 0:
        return user
    return _SLOT_UIDS + slot, _SLOT_UIDS + slot


def clean_user(user: tuple[int, int] | None, slot: int):
    """The user a slot's clean rooms run as: not the one its first sandbox runs as, so that
    nothing that sandbox left can write the clean room's files or signal it."""
    return None if user is None else (_CLEAN_UIDS + slot, _CLEAN_UIDS + slot)


def child_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
    return {k: os.environ[k] for k in keep if k in os.environ}


class Batch:
    """Runs up to `jobs` grading processes at a time and turns their events into rows."""

    def __init__(self, paths, *, chapters: list[Chapter], private: pathlib.Path, spec: dict,
                 jobs: int, snapshot: Snapshot | None, out, progress, resume: bool = False,
                 watch: bool = True):
        self.paths, self.chapters, self.private, self.spec = paths, chapters, private, spec
        self.out = pathlib.Path(out) if out is not None else None
        self.state: dict[str, dict] = {}          # notebook -> {"sha256", "state"}: --resume
        self.earlier = self._earlier() if resume and self.out is not None else ({}, {})
        self.jobs, self.snapshot, self.progress = max(1, jobs), snapshot, progress
        self.watch = watch            # can the notebooks write the installed package?
        self.rows: dict[int, list[Row]] = {}
        self.selector = selectors.DefaultSelector()
        self.running: dict[int, _Job] = {}
        self.halted = ""
        self.suspects: set[int] = set()
        self.before = frozenset(children_of(os.getpid()))    # not ours to end

    def run(self) -> list[Row]:
        pending = [(i, p) for i, p in enumerate(self.paths) if not self._resumed(i, p)]
        while pending or self.running:
            while pending and len(self.running) < self.jobs and not self.halted:
                self._start(*pending.pop(0))
            if self.halted and pending:
                for index, path in pending:
                    self.rows[index] = self._fallback(path, [], f"not graded: {self.halted}")
                pending = []
            self._poll()
        return [row for index in sorted(self.rows) for row in self.rows[index]]

    # ------------------------------------------------------------ --resume

    def _earlier(self) -> tuple[dict, dict]:
        """The rows and the state an earlier run left in `out` (empty where it left none)."""
        try:
            state = json.loads((self.out / STATE).read_text()).get("notebooks", {})
            rows = json.loads((self.out / "grades.json").read_text())
        except (OSError, ValueError, AttributeError):
            return {}, {}
        by_notebook: dict[str, list[Row]] = {}
        for r in rows if isinstance(rows, list) else []:
            try:
                by_notebook.setdefault(r["notebook"], []).append(Row(**r))
            except (TypeError, KeyError):
                continue
        return by_notebook, state if isinstance(state, dict) else {}

    def _resumed(self, index: int, path: pathlib.Path) -> bool:
        """Fill the rows of a notebook the earlier run finished, or was killed while grading;
        False when it is to be graded now."""
        rows, state = self.earlier
        then, label = state.get(str(path)), str(path)
        now = _digest(path) if isinstance(then, dict) else None    # read only with --resume
        if now is None or then.get("sha256") != now:
            return False
        shown = printable(label)                  # as the reports name it
        if then.get("state") == "done" and shown in rows:
            self.rows[index] = rows[shown]
        elif then.get("state") == "running":
            together = then.get("together", 1)
            why = "not graded: the grader was killed while it ran" + (
                f" (or while one of the {together - 1} notebooks graded at the same time ran: "
                "grade it alone to tell)" if isinstance(together, int) and together > 1 else "")
            self.rows[index] = self._fallback(path, [], why, _chapter_of(path, self.chapters))
        else:
            return False
        self.state[label] = {"sha256": now, "state": "done"}
        if self.progress:
            self.progress(path, self.rows[index], None)        # None: kept, not graded now
        return True

    def _save_state(self) -> None:
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.out / STATE, json.dumps({"notebooks": self.state}, indent=1).encode())

    def _start(self, index: int, path: pathlib.Path) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(self.private)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                   if p]))
        slot = min(set(range(self.jobs)) - {j.slot for j in self.running.values()})
        user = slot_user(self.spec["user"], slot, spread=self.spec.get("spread", False))
        spec = dict(self.spec, notebook=os.path.abspath(path), label=str(path), user=user,
                    batch=os.getpid(),
                    clean_user=clean_user(self.spec["user"], slot))
        stderr = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-I", "-c", BOOT],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                env=env, cwd=self.private, start_new_session=True)
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        job = _Job(index, path, proc, time.monotonic(), stderr, slot, user)
        self.running[proc.pid] = job
        self.state[str(path)] = {"sha256": _digest(path), "state": "running",
                                 "together": len(self.running)}
        for other in self.running.values():
            if self.state.get(str(other.path), {}).get("state") == "running":
                self.state[str(other.path)]["together"] = len(self.running)
        self._save_state()
        self.suspects.add(index)
        self.selector.register(proc.stdout, selectors.EVENT_READ, job)

    def _poll(self) -> None:
        for key, _ in self.selector.select(timeout=1.0):
            job = key.data
            chunk = os.read(key.fileobj.fileno(), 1 << 16)
            if chunk and len(job.buffer) < (16 << 20):
                job.buffer += chunk
                continue
            if chunk:                                    # 16 MiB of events: something is wrong
                with contextlib.suppress(OSError):
                    os.killpg(job.proc.pid, signal.SIGKILL)
            self.selector.unregister(key.fileobj)
            self._finish(job, job.proc.wait())
        limit = self.spec["limits"]["notebook"] + 180      # the job keeps its own deadline
        for job in list(self.running.values()):
            if time.monotonic() - job.started > limit:
                with contextlib.suppress(OSError):
                    os.killpg(job.proc.pid, signal.SIGKILL)

    def _finish(self, job: _Job, code: int) -> None:
        del self.running[job.proc.pid]
        end_descendants(keep=self.before | set(self.running))   # what its sandbox left behind
        events = []
        for line in job.buffer.decode(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
        reason = "" if any(e.get("event") in ("done", "unreadable") for e in events) else \
            _death(code, job.stderr)
        job.stderr.close()
        rows = self._rows(job, events, reason)
        self._integrity(job, rows)
        self.rows[job.index] = rows
        self.state[str(job.path)] = {"sha256": _digest(job.path), "state": "done"}
        if self.out is not None:
            write_reports([r for i in sorted(self.rows) for r in self.rows[i]], self.out)
        self._save_state()
        if self.progress:
            self.progress(job.path, rows, time.monotonic() - job.started)

    def _rows(self, job: _Job, events: list[dict], reason: str) -> list[Row]:
        """The notebook's rows: one per expected exercise, from the events, checked."""
        path, by_name = job.path, {c.path.name: c for c in self.chapters}
        for event in events:
            if event.get("event") == "unreadable":
                status = "ungradable" if event.get("status") == "ungradable" else "unreadable"
                return self._fallback(path, [], str(event.get("reason")),
                                      by_name.get(event.get("chapter")), status=status)
        chapter = next((by_name.get(e.get("chapter")) for e in events
                        if e.get("event") == "expected"), None)
        done = next((e for e in events if e.get("event") == "done"), {})
        flags = [str(f) for f in done.get("flags", []) if isinstance(f, str)]
        flags.append(self._ran_as(job))
        if chapter is None:
            return self._fallback(path, flags, f"not graded: {reason or 'no result'}")
        got = {e["row"].get("exercise"): e["row"] for e in events
               if e.get("event") == "row" and isinstance(e.get("row"), dict)}
        rows = []
        for ex in chapter.exercises:
            r = got.get(ex.name, {})
            status = str(r.get("status", "not graded"))
            passed = status == "passed" and r.get("passed") is True
            message = str(r.get("message", f"not graded: {reason or 'no result'}"))
            rows.append(Row(str(path), ex.name, passed, ex.points if passed else 0, ex.points,
                            message, status, "; ".join(flags), chapter.path.name, ex.optional))
        return rows

    def _fallback(self, path, flags, reason, chapter=None, *, status="not graded") -> list[Row]:
        flags = "; ".join(flags)
        if chapter is None or not chapter.exercises:
            return [Row(str(path), "-", False, 0, 0, reason, status, flags, "")]
        return [Row(str(path), ex.name, False, 0, ex.points, reason, status, flags,
                    chapter.path.name, ex.optional) for ex in chapter.exercises]

    def _ran_as(self, job: _Job) -> str:
        cap = "" if self.spec["limits"]["memory"] else "; no memory cap"
        box = "" if self.spec.get("confine") else "; no kernel sandbox (--trusted)"
        if job.user:
            uid = job.user[0]
            try:
                name = pwd.getpwuid(uid).pw_name
            except KeyError:
                name = "a user of its own"
            return f"ran as {name} (uid {uid}){cap}{box}"
        if self.spec.get("confine"):
            return (f"ran with your permissions (uid {os.geteuid()}) in a bubblewrap sandbox: "
                    f"it could read, not change, your files{cap}")
        return (f"ran with your permissions (uid {os.geteuid()}): the notebook's code could read "
                f"and change your files; see docs/GRADING.md{cap}{box}")

    def _integrity(self, job: _Job, rows: list[Row]) -> None:
        """Put the grader's files back if a notebook changed them: its private copy (which a
        notebook run with the grader's permissions could reach) always, the installed package
        when the notebooks could write it (`watch`)."""
        if self.snapshot is None:
            return
        private = self.snapshot.private_changes(self.private)
        changed = private + (self.snapshot.changes() if self.watch else [])
        if self.watch:
            self.snapshot.clean_caches()
        if not changed:
            self.suspects = {j.index for j in self.running.values()}
            return
        who = sorted(self.suspects)
        note = f"changed the grader's files: {', '.join(changed[:4])}"
        if len(who) > 1:
            note = f"it or a notebook graded at the same time ({len(who)} in all) " + note
        for r in rows:
            r.flags = "; ".join(filter(None, [r.flags, note]))
            r.status, r.points, r.passed = "tampered", 0, False
        if self.watch and self.snapshot.environment_changes():
            self.halted = f"an earlier notebook changed site-packages ({changed[-1]}); reinstall " \
                          "the environment and grade again, as root or in a container"
        if private:
            self.snapshot.restore_private(self.private)
        if self.watch:
            self.snapshot.restore()
        self.suspects = {j.index for j in self.running.values()}


STATE = "grades.state.json"     # which notebooks a run finished, and which it was grading


def _chapter_of(path: pathlib.Path, chapters: list[Chapter]) -> Chapter | None:
    try:
        nb = nbformat.reads(read_submission(path).decode("utf-8"), as_version=4)
    except Exception:
        nb = nbformat.v4.new_notebook()
    return match_chapter(nb, str(path), chapters)


def _death(code: int, stderr) -> str:
    stderr.seek(0)
    last = [ln for ln in stderr.read()[-4000:].decode(errors="replace").splitlines() if ln.strip()]
    how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
    return f"the grading process ended early ({how}{': ' + last[-1][:200] if last else ''})"
