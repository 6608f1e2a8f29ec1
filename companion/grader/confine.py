"""The kernel's side of a sandbox: every learner interpreter runs under bubblewrap (`bwrap`).

`sandbox.Child` starts the learner's interpreter through `Confinement.command`, which puts it in
new PID, mount, IPC, UTS and network namespaces:

- a read-only view of the whole system (`--ro-bind / /`): the course, the virtual environment and
  the grader's folders can be read where the user may read them, and nothing can be written;
- a private, size-capped tmpfs at /tmp (its home, its temporary files, its cwd) and at /dev/shm,
  which vanish with it, so that nothing one sandbox writes reaches another or outlives it; its
  minimal /dev (null, zero, random, tty...) is read-only (its device files still work);
- folders that must be absent replaced by empty tmpfs mounts (`hide`): the source notebooks with
  their solutions, the grader's report folder and the submissions; in a clean room also the
  package itself, whose withheld copy is bound in its place (`show`): the references are not
  hidden there, they are not in its filesystem at all;
- its own PID namespace, with `--die-with-parent`: when the sandbox's first process dies, the
  kernel kills every process it started, whatever session or process group they moved to, and
  none can see or signal a process outside;
- its own network namespace (only a loopback device: gloo's rendezvous on 127.0.0.1 works inside,
  and no abstract unix socket or port of another sandbox is reachable);
- as the sandbox's uid: bwrap runs as that user, in a user namespace of its own. Never as root:
  the grader refuses `--run-as self` as root (`--cap-drop ALL` is kept for safety should it run
  as root anyway).

Where bwrap is missing or the kernel refuses its namespaces (macOS, containers without user
namespaces), `available` says why; the grader then refuses to grade unless told `--trusted`.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess

__all__ = ["Confinement", "bwrap_path", "available", "runs", "attempt", "INSIDE"]

INSIDE = "/tmp/sandbox"          # the sandbox's home, cwd and TMPDIR, on its private tmpfs


def bwrap_path() -> str | None:
    """bubblewrap's executable, or None."""
    return shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None)


@dataclasses.dataclass(frozen=True)
class Confinement:
    """What one sandbox sees. `hide`: folders replaced by empty ones; `show`: folders bound again,
    read-only, after the hiding (a path under a hidden folder reappears alone); `blank`: files
    that read as empty; `disk`: bytes of its /tmp (and again of its /dev/shm)."""
    bwrap: str
    hide: tuple[str, ...] = ()
    show: tuple[str, ...] = ()
    blank: tuple[str, ...] = ()
    disk: int = 2 * 2**30

    def with_(self, *, hide=(), show=()) -> "Confinement":
        """This confinement with more folders hidden (no longer shown, nor anything under them)
        and more shown (a clean room's: the package hidden, its withheld copy shown)."""
        kept = tuple(s for s in self.show if not any(_under(s, h) for h in hide))
        return dataclasses.replace(self, hide=self.hide + tuple(hide), show=kept + tuple(show))

    def command(self, argv: list[str], *, as_root: bool) -> list[str]:
        """bwrap's command line that runs `argv` confined (cwd and home: `INSIDE`)."""
        cmd = [self.bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--remount-ro", "/dev",
               "--proc", "/proc",
               "--size", str(self.disk), "--tmpfs", "/tmp",
               "--size", str(self.disk), "--tmpfs", "/dev/shm"]
        for device in sorted(glob.glob("/dev/nvidia*")) + (["/dev/dri"] if os.path.exists(
                "/dev/dri") else []):
            cmd += ["--dev-bind", device, device]           # a GPU grader's devices
        for folder in _outermost(p for p in self.hide if os.path.isdir(p)):
            if not _under(folder, "/tmp"):
                cmd += ["--size", str(2**20), "--tmpfs", folder]
        for path in self.blank:
            if os.path.isfile(path) and not _under(path, "/tmp"):
                cmd += ["--ro-bind", "/dev/null", path]
        covered = ["/tmp", *self.hide]         # a path elsewhere is seen through / already
        for folder in self.show:
            if any(_under(folder, c) for c in covered) and os.path.exists(folder):
                cmd += ["--ro-bind", folder, folder]
        cmd += ["--dir", INSIDE, "--chdir", INSIDE,
                "--unshare-pid", "--unshare-ipc", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", "--die-with-parent", "--new-session",
                "--hostname", "sandbox"]
        if as_root:
            cmd += ["--cap-drop", "ALL"]
        return cmd + ["--"] + argv


def _under(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _outermost(folders) -> list[str]:
    """The folders with none inside another (hiding the outer one hides the inner)."""
    folders = sorted({os.path.abspath(f) for f in folders}, key=len)
    kept: list[str] = []
    for f in folders:
        if not any(_under(f, k) for k in kept):
            kept.append(f)
    return kept


def available(user: tuple[int, int] | None, env: dict[str, str], *,
              timeout: float = 60.0) -> str:
    """'' when bwrap can confine a process as `user` (None: this process's user) here; else why
    not, in a sentence."""
    path = bwrap_path()
    if path is None:
        return "bubblewrap (bwrap) is not installed (Debian and Ubuntu: apt install bubblewrap)"
    why = runs(Confinement(path, disk=2**20), ["/bin/sh", "-c", "exit 0"], user, env,
               timeout=timeout)
    return why and f"bwrap cannot create its namespaces here ({why})"


def runs(conf: Confinement, argv: list[str], user: tuple[int, int] | None,
         env: dict[str, str], *, timeout: float = 120.0) -> str:
    """'' when `argv` runs and exits 0 under `conf` as `user`; else why not, in a sentence (the
    grader asks this of its own Python and the course before grading anything)."""
    as_root = user is None and os.geteuid() == 0
    return attempt(conf.command(argv, as_root=as_root), user, env, timeout=timeout,
                   what="bwrap")


def attempt(argv: list[str], user: tuple[int, int] | None, env: dict[str, str], *,
            timeout: float, what: str) -> str:
    """'' when `argv` runs as `user` (None: this process's) and exits 0; else why not: the last
    line it printed, or what stopped it (`what` names it in the sentence)."""
    extra = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
    try:
        result = subprocess.run(argv, env=dict(env, HOME="/"), cwd="/",
                                stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                                **extra)
    except subprocess.TimeoutExpired:
        return f"{what} took more than {timeout:g} s"
    except OSError as e:
        return f"{what} could not start: {type(e).__name__}: {e}"
    if result.returncode:
        lines = [ln for ln in result.stderr.decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else f"exit code {result.returncode}"
    return ""
