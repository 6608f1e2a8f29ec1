"""Grade learners' notebooks so that an instructor can trust the scores.

    python -m companion grade submissions/ --out grades/ --jobs 4

- The grader knows what to expect: exercises, checks and points come from the course's source
  notebooks (`--source`, default course/) and the check registry, never from the submission.
  One row per expected exercise; a deleted or changed check line scores 0 as "tampered"; a check
  called twice counts once.
- Results the learner's code cannot forge: each notebook's cells run in a sandbox (a fresh
  interpreter in a session of its own, as `nobody` when the grader is root, or as a uid of its own
  when other notebooks are graded at the same time) and the checks run in a grading process that
  runs no learner code. Only return values come back, read as plain data
  (`torch.load(weights_only=True)`, plain tensors only) and compared there with a reference
  computed there. Displayed output is never read. An answer that uses the exercise's reference
  implementation scores 0: each answer that passes is graded again in a clean room, a fresh
  interpreter that imports a copy of the package without that reference (`grader.cleanroom`).
- Hard limits: a deadline per cell, per exercise and per notebook, after which the sandbox's
  process group is killed; a memory cap (RLIMIT_AS); an output cap; every process a notebook
  started is killed when it is done (the grading process is a child subreaper).
- One bad notebook never costs the others: each is graded in its own processes; unreadable files
  become a row with the reason; reports are rewritten atomically after every notebook, so a killed
  grader leaves those finished (`--resume` carries on from there); their SHA-256 is printed and
  stored in grades.sha256.

See docs/GRADING.md for what this guarantees, what it does not, and how to grade in containers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import sys

from companion.grader.batch import Batch, child_env, sandbox_user
from companion.grader.confine import available, bwrap_path, runs
from companion.grader.session import confinement as session_confinement
from companion.grader.expected import read_chapter
from companion.grader.integrity import Snapshot
from companion.grader.reports import Row, escape_csv, format_table, write_reports
from companion.grader.sandbox import Limits, end_descendants, unreachable
from companion.grader.stopping import Guard

__all__ = ["Row", "SetupError", "grade", "grade_notebook", "write_reports", "format_table", "escape_csv"]

REPO = pathlib.Path(__file__).resolve().parent.parent


def _notebooks(paths) -> list[pathlib.Path]:
    out = []
    for p in map(pathlib.Path, paths):
        if p.is_dir():
            out += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        else:
            out.append(p)
    return out


def grade(paths, *, cell_timeout: float = 120.0, exercise_timeout: float = 60.0,
          notebook_timeout: float = 1800.0, memory: int | None = None, output: int = 2**20,
          jobs: int = 1, source: str | pathlib.Path | None = None, run_as: str = "auto",
          out: str | pathlib.Path | None = None, progress=None, resume: bool = False,
          trusted: bool = False, disk: int = 2 * 2**30, hide=()) -> list[Row]:
    """Grade notebooks (files, or folders of them) against the source notebooks in `source`.

    Returns one Row per expected exercise of each notebook (or one row saying why a file could
    not be graded). With `out`, the reports are rewritten there after every notebook. `run_as`:
    "auto" (nobody when root, else yourself), "self", or a user name (needs root). `memory`:
    bytes of address space per notebook, 0 for no cap; None: 8 GiB, or no cap where CUDA is
    available (CUDA reserves far more address space than it uses). `resume`: keep the rows of
    notebooks an earlier run in `out` finished (when their files are unchanged) and grade the
    rest; a notebook that was running when that run was killed is "not graded" with the reason.
    Every notebook and clean room runs under bubblewrap (`grader.confine`: namespaces of its own,
    a read-only system, a private `disk`-byte tmpfs; `hide`: more folders absent from it, such
    as other copies of the course on this machine); `trusted=True` grades without it (the
    notebooks' code is then contained only by the limits, the uid and the integrity checks).
    Raises SetupError (before grading anything) when the sandbox's user cannot run this Python,
    or bubblewrap cannot run here and `trusted` is not set."""
    sources = sorted(pathlib.Path(source or REPO / "course").glob("[0-9][0-9]_*.ipynb"))
    import companion
    package = pathlib.Path(companion.__file__).resolve().parent
    user = sandbox_user(run_as)
    if user is not None:
        _check_reachable(user)
    if not trusted and os.geteuid() == 0 and (user is None or user[0] == 0):
        raise SetupError(
            "as root, --run-as self (or root) would run the notebooks' code as root, which no "
            "sandbox confines (the kernel's settings under /proc/sys, root's keyring and files "
            "only root may read stay within its reach). Grade with --run-as auto (the notebooks "
            "run as nobody and uids of their own), or run the grader as an unprivileged user, or, "
            "for code you trust, add --trusted.")
    if disk < 16 * 2**20:
        raise SetupError(f"--disk must be at least 16MiB, got {disk} bytes")
    confine = None
    if not trusted:
        why = available(user, child_env())
        if why:
            raise SetupError(
                f"the grader runs every notebook in a kernel sandbox, and it cannot here: {why}. "
                "Install bubblewrap, or, for code you trust or inside a throw-away container, "
                "grade with --trusted (no kernel sandbox; see docs/GRADING.md, \"The sandbox\").")
        confine = _confinement(paths, sources, package, out, disk)
        confine["hide"] += [str(pathlib.Path(h).resolve()) for h in hide]   # other copies
        conf = session_confinement({"confine": confine})
        why = runs(conf, [sys.executable, "-P", "-c", "import torch, IPython, "
                          "companion.grader.child"], user, child_env())
        if why:
            raise SetupError(f"this Python ({sys.executable}) cannot start in the grader's "
                             f"sandbox: {why}. A virtual environment must be readable by the "
                             "sandbox's user; see docs/GRADING.md, \"The sandbox\".")
    snapshot = Snapshot(package, sources)
    guard = Guard()          # a signal raises Stopped once the cleanup below is sure to run
    private = snapshot.private_copy()
    import torch
    cuda = torch.cuda.is_available()
    if memory is None:
        memory = 0 if cuda else 8 * 2**30
    limits = Limits(cell=cell_timeout, exercise=exercise_timeout, notebook=notebook_timeout,
                    memory=memory, output=output, grader_memory=0 if cuda else 6 * 2**30)
    from companion.results import RESULTS_DIR
    spec = {"chapters": [str(private / "sources" / p.name) for p in sources],
            "limits": dataclasses.asdict(limits), "user": user, "child_env": child_env(),
            "spread": run_as == "auto", "private": str(private), "digests": snapshot.digests(),
            "results": str(RESULTS_DIR), "confine": confine,
            "package_dirs": _package_dirs(package)}
    chapters = [read_chapter(private / "sources" / p.name) for p in sources]
    subreaper = _subreaper(True)
    watch = not user or snapshot.open_to_all()      # can the notebooks write the grader's files?
    batch = Batch(_notebooks(paths), chapters=chapters, private=private, spec=spec, jobs=jobs,
                  snapshot=snapshot, watch=bool(watch), out=out, progress=progress,
                  resume=resume)
    try:
        guard.open()
        return batch.run()
    finally:
        guard.shut()
        _end_jobs(batch)
        end_descendants(keep=batch.before)
        _subreaper(subreaper)
        Snapshot.remove(private)
        guard.restore()


def _end_jobs(batch: Batch, grace: float = 5.0) -> None:
    """End the grading processes still running (a grader stopped by a signal): SIGTERM first, so
    that each removes its clean rooms and sandboxes (`stopping.on_signals` in job.main), then,
    after `grace` seconds, SIGKILL."""
    import time
    for job in batch.running.values():
        with contextlib.suppress(OSError):
            os.killpg(job.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for job in batch.running.values():
        with contextlib.suppress(Exception):
            job.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        with contextlib.suppress(OSError):
            os.killpg(job.proc.pid, signal.SIGKILL)


def _confinement(paths, sources: list[pathlib.Path], package: pathlib.Path, out,
                 disk: int) -> dict:
    """The sandbox's filesystem (`grader.confine.Confinement`'s fields): absent from it are the
    source notebooks (their solutions), the report folder and the submissions, except a folder
    that holds what the sandbox must run (this Python, the package): there only the files are
    blanked. Shown again (read-only, also where they are under /tmp): the package, the folders on
    PYTHONPATH, and the recorded results folder the package reads."""
    from companion.results import RESULTS_DIR
    needed = [pathlib.Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.executable,
                                                   package, RESULTS_DIR)]
    hide, blank = [], []

    def away(folder: pathlib.Path, files) -> None:
        folder = folder.resolve()
        if any(n == folder or folder in n.parents for n in needed):
            blank.extend(os.path.abspath(f) for f in files if _regular(f))
        else:
            hide.append(str(folder))

    for folder in {p.parent for p in sources}:
        away(folder, sources)
    if out is not None:
        away(pathlib.Path(out), [])
    for p in map(pathlib.Path, paths):
        if p.is_dir():
            away(p, _notebooks([p]))
        elif _regular(p):
            blank.append(os.path.abspath(p))
    path = [p for p in child_env().get("PYTHONPATH", "").split(os.pathsep) if p]
    runs = {sys.prefix, sys.base_prefix, os.path.dirname(sys.executable),
            os.path.dirname(os.path.realpath(sys.executable))}
    show = [str(RESULTS_DIR), str(package), *path, *sorted(runs)]   # what it runs and imports,
    # shown again where it is under /tmp (a virtual environment there)
    return {"bwrap": bwrap_path(), "hide": hide, "show": show, "blank": blank, "disk": int(disk)}


def _regular(path) -> bool:
    """A regular file, not followed through a symbolic link (nothing else is blanked)."""
    import stat
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _package_dirs(package: pathlib.Path) -> list[str]:
    """Every folder that holds the course's code with its references, for the clean room to leave
    out: the package the grader uses, the one this Python imports without PYTHONPATH (an
    installed or editable copy, which `importlib.metadata` would lead to), and in each checkout
    beside them its tests, notebooks and git history."""
    import subprocess
    found = {package.resolve()}
    probe = subprocess.run([sys.executable, "-I", "-c", "import importlib.util as u; "
                            "s = u.find_spec('companion'); print(s.origin if s else '')"],
                           capture_output=True, text=True, cwd="/", timeout=120)
    if probe.returncode == 0 and probe.stdout.strip().endswith("__init__.py"):
        found.add(pathlib.Path(probe.stdout.strip()).resolve().parent)
    out = set(found)
    for pkg in found:
        if (pkg.parent / "pyproject.toml").is_file():                    # a checkout
            out |= {pkg.parent / name for name in ("tests", "course", ".git", "benchmarks")}
    return sorted(str(p) for p in out if p.exists())


class SetupError(RuntimeError):
    """The grader cannot grade anything as set up; the message says what to do."""


def _check_reachable(user: tuple[int, int]) -> None:
    why = unreachable(user, child_env())
    if not why:
        return
    import pwd
    try:
        name = pwd.getpwuid(user[0]).pw_name
    except KeyError:
        name = f"uid {user[0]}"
    raise SetupError(
        f"the grader runs notebooks as {name} (uid {user[0]}), because it runs as root, and "
        f"{name} cannot start this Python ({sys.executable}): {why}. Make the virtual "
        "environment from an interpreter every user can run, in a folder every user can enter, "
        "with the course installed from such a folder (e.g. /usr/bin/python3 -m venv "
        "/opt/oom-venv; /opt/oom-venv/bin/pip install -e /srv/out-of-memory), or grade with "
        "--run-as self (the notebooks then run with your permissions; see docs/GRADING.md, "
        "\"Running it as root\").")


def _subreaper(on: bool) -> bool:
    """Make this process a child subreaper (or not); return whether it was one before."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        was = ctypes.c_int(0)
        libc.prctl(37, ctypes.byref(was), 0, 0, 0)          # PR_GET_CHILD_SUBREAPER
        libc.prctl(36, int(on), 0, 0, 0)                    # PR_SET_CHILD_SUBREAPER
        return bool(was.value)
    except (OSError, AttributeError):
        return False


def grade_notebook(path: str | pathlib.Path, **options) -> list[Row]:
    """Grade one notebook; the options are those of `grade`."""
    return grade([path], **options)
