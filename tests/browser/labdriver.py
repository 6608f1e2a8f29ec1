"""Start JupyterLab and Debian's Chromium as child processes, and stop them by process id.

`LabServer` runs `jupyter lab` on 127.0.0.1 with a random free port and a random token, in its own
configuration, data, runtime, settings and workspace folders, so nothing of the user's setup leaks
in. `Chromium` runs the system browser headless with a fresh profile and a DevTools port that
Playwright attaches to (`connect_over_cdp`), so the browser is our child and we hold its pid.
Both are started with `start_new_session=True`: each leads its own process group, whose id is its
pid, so `stop()` can also end what it started (kernels, renderers) by that id.
"""
from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

REPO = pathlib.Path(__file__).resolve().parents[2]
COURSE = REPO / "course"
CHROMIUM = pathlib.Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


def course_notebooks() -> list[str]:
    """Every chapter notebook in course/, found when the tests are collected."""
    return sorted(p.name for p in COURSE.glob("[0-9][0-9]_*.ipynb"))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, *, grace: float = 10.0) -> None:
    """SIGTERM the process `proc.pid`, SIGKILL it after `grace` seconds, then SIGKILL whatever is
    left of the process group it leads (its group id is its pid: see start_new_session)."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(grace)
    try:
        os.killpg(proc.pid, signal.SIGKILL)     # children it left behind, if any
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: pathlib.Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class _OwnedProcess:
    """A process this suite started: stopped by its pid on exit, also when starting it failed."""

    proc: subprocess.Popen | None = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class LabServer(_OwnedProcess):
    """`jupyter lab` serving `root` on 127.0.0.1:<free port> with a token; a context manager."""

    def __init__(self, root: pathlib.Path, state: pathlib.Path):
        self.root, self.state = root, state
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.log = state / "jupyterlab.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _environment(self) -> dict[str, str]:
        self.state.mkdir(parents=True, exist_ok=True)
        dirs = {name: self.state / name for name in ("config", "data", "runtime", "settings",
                                                     "workspaces")}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        (dirs["config"] / "labconfig").mkdir(exist_ok=True)
        (dirs["config"] / "labconfig" / "page_config.json").write_text(json.dumps(
            {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
        # Every cell attached and laid out, also off screen, and no blank space after the last, so
        # the whole notebook can be read and pictured.
        tracker = dirs["settings"] / "@jupyterlab" / "notebook-extension"
        tracker.mkdir(parents=True, exist_ok=True)
        (tracker / "tracker.jupyterlab-settings").write_text(json.dumps(
            {"windowingMode": "none", "scrollPastEnd": False}))
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(dirs["config"]),
                   JUPYTER_DATA_DIR=str(dirs["data"]), JUPYTER_RUNTIME_DIR=str(dirs["runtime"]),
                   JUPYTERLAB_SETTINGS_DIR=str(dirs["settings"]),
                   JUPYTERLAB_WORKSPACES_DIR=str(dirs["workspaces"]))
        env.pop("MPLBACKEND", None)             # the kernel picks its inline backend itself
        env.pop("OMP_NUM_THREADS", None)        # a learner's kernel: the default threads, which
                                                # the first cell's session.start() lowers
        return env

    def start(self, *, timeout: float = 120.0) -> "LabServer":
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
               f"--port={self.port}", "--port-retries=0", f"--ServerApp.root_dir={self.root}",
               f"--IdentityProvider.token={self.token}", "--LabApp.expose_app_in_browser=True",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        env = self._environment()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n"
                                   f"{_tail(self.log)}")
            try:
                self.api("GET", "status")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        raise RuntimeError(f"jupyter lab did not answer within {timeout:g} s:\n{_tail(self.log)}")

    def api(self, method: str, path: str):
        """One call of Jupyter Server's REST API; returns the decoded JSON (None if empty)."""
        request = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Shut down every running kernel (between notebooks, so they do not pile up)."""
        for kernel in self.api("GET", "kernels"):
            self.api("DELETE", f"kernels/{kernel['id']}")

    def page_url(self, notebook: str) -> str:
        """The address that opens `notebook` (relative to root) in a fresh workspace."""
        return f"{self.url}/lab/tree/{notebook}?reset&token={self.token}"



class Chromium(_OwnedProcess):
    """Headless system Chromium with a fresh profile, reachable over the DevTools protocol."""

    def __init__(self, profile: pathlib.Path, executable: pathlib.Path = CHROMIUM):
        self.profile, self.executable = profile, executable
        self.log = profile.parent / "chromium.log"
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""

    def start(self, *, timeout: float = 60.0) -> "Chromium":
        self.profile.mkdir(parents=True, exist_ok=True)
        port_file = self.profile / "DevToolsActivePort"
        cmd = [str(self.executable), *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
               "about:blank"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}:\n"
                                   f"{_tail(self.log)}")
            lines = port_file.read_text().split() if port_file.exists() else []
            if len(lines) == 2:                 # "<port>\n/devtools/browser/<id>\n"
                self.endpoint = f"http://127.0.0.1:{lines[0]}"
                return self
            time.sleep(0.2)
        raise RuntimeError(f"chromium opened no DevTools port within {timeout:g} s:\n"
                           f"{_tail(self.log)}")

