"""The grader's side of a sandbox: start a learner's interpreter under hard limits, talk to it over
two private pipes, and end it together with every process it started.

The limits are set from outside the learner's code: the interpreter applies its memory, file-size
and process limits (soft and hard) before any learner code runs; every wait here has a wall-clock
deadline after which the sandbox's whole process group is killed (SIGKILL, which no code can
ignore); output beyond a cap is read and dropped. A grader running as root starts the sandbox as
an unprivileged user, so the learner's code can neither signal the grader nor write its files.
The grading process makes itself a child subreaper: processes the notebook started, even in a
session of their own, are re-parented to it when their parents die, and `end_descendants` kills
them all.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from companion.grader import wire
from companion.grader.confine import INSIDE, Confinement, attempt

__all__ = ["Limits", "Child", "ChildLost", "harden_self", "children_of",
           "unreachable", "end_descendants"]

_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36


@dataclasses.dataclass
class Limits:
    """Hard limits for one notebook (seconds and bytes; 0 memory means no cap)."""
    cell: float = 120.0          # one cell that is not a check
    exercise: float = 60.0       # at least this long for one exercise's check
    notebook: float = 1800.0     # the whole notebook, restarts included
    memory: int = 8 * 2**30      # address space of the learner's interpreter (RLIMIT_AS)
    output: int = 2**20          # output kept; the rest is read and dropped
    file_size: int = 2**30       # largest file the learner's code may write (RLIMIT_FSIZE)
    grace: float = 5.0           # after an interrupt or a deadline, before SIGKILL
    reply: int = 64 * 2**20      # largest reply read from the sandbox; a larger one is refused
    grader_memory: int = 6 * 2**30   # address space of the grading process itself (0: none)


class ChildLost(Exception):
    """The sandbox died, stopped answering, or answered with something that is not plain data."""

    def __init__(self, reason: str, *, timed_out: bool = False, refused: bool = False):
        super().__init__(reason)
        self.reason, self.timed_out, self.refused = reason, timed_out, refused


def harden_self() -> None:
    """Make this process a child subreaper and not ptrace-able by same-user processes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass                     # not Linux: the report says processes may outlive grading


def _children() -> dict[int, list[int]]:
    """{parent pid: [child pids]} from one read of /proc (Linux; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def children_of(pid: int) -> list[int]:
    """Direct children of pid, read from /proc (Linux)."""
    return _children().get(pid, [])


def end_descendants(*, keep: frozenset[int] = frozenset(), rounds: int = 50) -> int:
    """Kill every child of this process except `keep`, again and again as their own children are
    re-parented here (we are their subreaper), and reap them. Returns how many were killed."""
    killed = 0
    for _ in range(rounds):
        strays = [pid for pid in children_of(os.getpid()) if pid not in keep]
        _reap(keep)
        if not strays:
            return killed
        for pid in strays:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            killed += 1
        time.sleep(0.05)
        _reap(keep)
    return killed


def _reap(keep: frozenset[int]) -> None:
    for pid in children_of(os.getpid()):
        if pid not in keep:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def unreachable(user: tuple[int, int], env: dict[str, str], *, timeout: float = 300.0) -> str:
    """'' when `user` can start this interpreter and import what a sandbox needs; else why not
    (a virtual environment made from a Python under /root, a checkout in a folder of mode 700)."""
    return attempt([sys.executable, "-P", "-c", "import torch, IPython, companion.grader.child"],
                   user, env, timeout=timeout, what="starting it")


class Child:
    """One sandboxed interpreter (companion.grader.child) and the pipes to it."""

    def __init__(self, *, limits: Limits, user: tuple[int, int] | None, env: dict[str, str],
                 modules: tuple[str, ...] = (), withheld: dict | None = None,
                 confine: Confinement | None = None):
        self.limits, self.user, self.base_env, self.modules = limits, user, env, modules
        self.withheld = withheld or {}       # a clean room's preload and outside references
        self.confine = confine               # None: no kernel sandbox (`--trusted`)
        self.proc: subprocess.Popen | None = None
        self.output, self.output_total = bytearray(), 0

    # ------------------------------------------------------------ start and end

    def start(self, *, timeout: float) -> dict:
        self.before = frozenset(children_of(os.getpid()))      # not ours to end in kill()
        # Confined, its home is on its own tmpfs (INSIDE); else a folder made here for it.
        self.workdir = None if self.confine else tempfile.mkdtemp(prefix="companion-sandbox-")
        home = INSIDE if self.confine else self.workdir
        req_r, self.req_w = os.pipe()
        self.rep_r, rep_w = os.pipe()
        as_root = self.user is None and os.geteuid() == 0
        # RLIMIT_NPROC counts a uid's processes: per sandbox where it has a uid (or a user
        # namespace) of its own; root is exempt from it.
        processes = 4096 if self.user or (self.confine and not as_root) else 0
        limits = {"memory": self.limits.memory, "file_size": self.limits.file_size,
                  "processes": processes, "modules": list(self.modules), **self.withheld}
        env = dict(self.base_env, HOME=home, TMPDIR=home, USER="sandbox", LOGNAME="sandbox",
                   MPLCONFIGDIR=os.path.join(home, ".matplotlib"), MPLBACKEND="Agg",
                   IPYTHONDIR=os.path.join(home, ".ipython"))
        user = {}
        if self.user:
            if self.workdir:
                os.chown(self.workdir, *self.user)
            user = {"user": self.user[0], "group": self.user[1], "extra_groups": []}
        argv = [sys.executable, "-P", "-m", "companion.grader.child", str(req_r), str(rep_w),
                json.dumps(limits)]
        if self.confine:
            argv = self.confine.command(argv, as_root=as_root)
        self.proc = subprocess.Popen(
            argv, pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self.workdir or "/", env=env,
            start_new_session=True, **user)
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(self.req_w, False)
        threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()
        reply = self._receive(time.monotonic() + timeout, interrupt=False)
        if reply.get("status") != "ready":
            self.kill()
            raise ChildLost("the sandbox did not start")
        return reply

    def _drain(self, stream) -> None:
        """Keep the first `output` bytes of what the learner's code prints; drop the rest."""
        for chunk in iter(lambda: stream.read1(65536), b""):
            self.output_total += len(chunk)
            room = self.limits.output - len(self.output)
            if room > 0:
                self.output += chunk[:room]

    def kill(self) -> None:
        """SIGKILL the sandbox's process group, reap it, and end every process it left behind."""
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        end_descendants(keep=self.before)
        for fd in (self.req_w, self.rep_r):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.proc = None
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------ requests

    def request(self, message: dict, *, timeout: float, interrupt: bool = False) -> dict:
        """Send a request; return the reply, or kill the sandbox and raise ChildLost."""
        deadline = time.monotonic() + max(timeout, 0.0)
        try:
            body = pickle.dumps(message)
            self._write(wire.frame(body), deadline)
            return self._receive(deadline, interrupt=interrupt)
        except ChildLost:
            raise
        except (OSError, EOFError) as e:
            raise self._lost(f"the notebook's process ended ({self._exit_text()})") from e

    def _write(self, data: bytes, deadline: float) -> None:
        while data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.req_w], [], left)[1]:
                raise self._lost("the notebook's process stopped reading", timed_out=True)
            data = data[os.write(self.req_w, data):]

    def _receive(self, deadline: float, *, interrupt: bool) -> dict:
        header = self._read(4, deadline, interrupt)
        n = int.from_bytes(header, "big")
        if n > min(wire.MAX_BYTES, self.limits.reply):          # refused before it is read
            raise self._lost(f"it sent a reply of {n / 2**20:.1f} MiB, over the grader's limit "
                             f"of {self.limits.reply / 2**20:g} MiB: return less", refused=True)
        try:
            return wire.decode(self._read(n, deadline, interrupt))
        except wire.WireError as e:
            raise self._lost(f"the notebook's process sent {e}") from None

    def _read(self, n: int, deadline: float, interrupt: bool) -> bytes:
        chunks, left = [], n
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self.rep_r], [], [], wait)[0]:
                if interrupt and not chunks:
                    interrupt = False                      # one SIGINT, then SIGKILL
                    with contextlib.suppress(OSError):
                        os.kill(self.proc.pid, signal.SIGINT)
                    deadline = time.monotonic() + self.limits.grace
                    continue
                raise self._lost("it ran past its time limit and was ended", timed_out=True)
            chunk = os.read(self.rep_r, min(left, 1 << 20))
            if not chunk:
                raise self._lost(f"the notebook's process ended ({self._exit_text()})")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _exit_text(self) -> str:
        try:
            code = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "it closed its channel"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _lost(self, reason: str, *, timed_out: bool = False, refused: bool = False) -> ChildLost:
        self.kill()
        return ChildLost(reason, timed_out=timed_out, refused=refused)
