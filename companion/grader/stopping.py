"""A grader stopped by a signal cleans up before it goes; one killed outright is cleaned up after.

The batch and each grading process hold copies of the course that learners must not read: the
private copy (`integrity.Snapshot.private_copy`: the source notebooks, solutions included) and the
clean rooms' packages. `on_signals` turns every signal whose default action ends the process (and
that a process can catch: SIGKILL and SIGSTOP it cannot) into a `Stopped` exception, raised where
the process is, so the `finally` blocks that remove those copies run; a second signal while they
run is ignored, so that the cleanup finishes. SIGKILL leaves the copy behind: its folder's name
records the pid and start time of the process that made it, and `remove_stale` (called by the next
`private_copy`) deletes those whose process is gone. (signal(7): the signals whose default action
is "Term" or "Core".)
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shutil
import signal
import stat
import tempfile
import threading

__all__ = ["Stopped", "Guard", "on_signals", "stop_by_default", "die_with_parent", "tag", "remove_stale"]

_ENDING = ("SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGALRM",
           "SIGVTALRM", "SIGPROF", "SIGXCPU", "SIGPOLL", "SIGSYS", "SIGTRAP")
ENDING = tuple(getattr(signal, name) for name in dict.fromkeys(_ENDING) if hasattr(signal, name))


class Stopped(BaseException):
    """The process received `signum`; raised where it was, so that cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Guard:
    """Each of `signals` raises Stopped while the guard is open; while it is shut (before the
    cleanup's `try` is entered, and during the cleanup), a signal is held and raised when it opens,
    or, at `restore`, sent again with the handlers it replaced. Handlers someone else set (not the
    default, not Python's SIGINT) are kept. Outside the main thread, where Python cannot set
    handlers, it does nothing."""

    def __init__(self, signals=ENDING):
        self.armed, self.fired, self.held = False, 0, []
        self.saved = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signals:
            current = signal.getsignal(signum)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                self.saved[signum] = current
                signal.signal(signum, self._handler)

    def _handler(self, signum, frame):
        if self.fired:
            return                                  # the cleanup runs: let it finish
        if not self.armed:
            self.held.append(signum)
            return
        self.fired = signum
        raise Stopped(signum)

    def open(self) -> None:
        self.armed = True
        if self.held and not self.fired:
            self.fired = self.held.pop(0)
            raise Stopped(self.fired)

    def shut(self) -> None:
        self.armed = False

    def restore(self) -> None:
        for signum, current in self.saved.items():
            signal.signal(signum, current)
        if self.held and not self.fired:        # came during the cleanup: acted on now
            os.kill(os.getpid(), self.held[0])


@contextlib.contextmanager
def on_signals(signals=ENDING):
    """Within the block, each of `signals` raises Stopped (once: later ones are ignored, so that
    the cleanup the first one started finishes)."""
    guard = Guard(signals)
    try:
        guard.open()
        yield
    finally:
        guard.shut()
        guard.restore()


def stop_by_default(stopped: Stopped) -> None:
    """End this process by the signal that stopped it, with its default action (so that the
    exit status says which, as if no handler had run)."""
    signal.signal(stopped.signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [stopped.signum])
    os.kill(os.getpid(), stopped.signum)


def die_with_parent(parent: int | None) -> None:
    """Have the kernel send this process SIGTERM when its parent, `parent`, ends, even by SIGKILL
    (prctl(2), PR_SET_PDEATHSIG), so that a grading process whose batch was killed still removes
    its clean rooms and sandboxes; if `parent` has ended already, now. Linux only."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)             # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


# ---------------------------------------------------------------- copies left by SIGKILL

_TAGGED = re.compile(r"^(?P<prefix>companion-[a-z]+)-(?P<pid>\d+)\.(?P<start>\d+)-")


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if
    there is no such process: with the pid, it tells a process from a later one given its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = stat_line[stat_line.rfind(")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


def tag(prefix: str) -> str:
    """A temporary folder's prefix naming this process: `prefix-PID.START-`."""
    return f"{prefix}-{os.getpid()}.{_start_time(os.getpid()) or 0}-"


def remove_stale(prefix: str, folder: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """Delete the folders `tag(prefix)` named in `folder` (the temp folder) whose process is gone
    (no such pid, or one started at another time), owned by this user and not symlinks; return
    them. Folders of a live process, or with no pid in their name, are left alone."""
    folder = pathlib.Path(folder or tempfile.gettempdir())
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _TAGGED.match(entry.name)
        if not match or match["prefix"] != prefix:
            continue
        try:
            st = os.lstat(entry.path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _start_time(int(match["pid"])) == int(match["start"]):
            continue                                      # its grader is still running
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(pathlib.Path(entry.path))
    return removed
