#!/usr/bin/env python3
"""Set up the course and run it: the two commands of the README.

    python3 tasks.py lab     # set up, create your workbook, open it in JupyterLab
    python3 tasks.py test    # set up, run the unit tests and execute every notebook under nbval

`test` includes the browser tests in tests/browser (JupyterLab driven by Chromium), which are
skipped, with the reason, where /usr/bin/chromium is missing.

Setup makes a virtual environment in .venv, installs PyTorch there if it has none (a torch you
installed yourself, e.g. a CUDA build, is kept), then the companion package with its test
extras. Both commands are safe to re-run; the second time, setup only checks that nothing changed.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import venv

ROOT = pathlib.Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".setup-stamp"
TORCH = "torch==2.13.0"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")


def _run(*cmd: object) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def _has(*modules: str) -> bool:
    return subprocess.run([str(PYTHON), "-c", f"import {', '.join(modules)}"], cwd=ROOT,
                          capture_output=True).returncode == 0


def setup() -> None:
    """Create .venv and install what the course needs, skipping what is already done."""
    if sys.version_info < (3, 10):
        sys.exit(f"Python 3.10 or newer is needed; this is {sys.version.split()[0]}.")
    if not PYTHON.exists():
        print(f"creating {VENV.name}/", flush=True)
        venv.create(VENV, with_pip=True)
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted and _has("torch", "companion"):
        return
    pip = [PYTHON, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    if not _has("torch"):
        _run(*pip, TORCH)
    _run(*pip, "-e", f"{ROOT}[dev]")
    STAMP.write_text(wanted)


def lab(args: list[str]) -> None:
    """Create the missing workbooks and open JupyterLab on them."""
    _run(PYTHON, "-m", "companion", "workbook")
    cmd = [str(BIN / "jupyter"), "lab", f"--notebook-dir={ROOT / 'workbook'}", "--ip=127.0.0.1"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    print("+", " ".join(cmd + args), flush=True)
    os.chdir(ROOT)
    os.execv(cmd[0], cmd + args)          # JupyterLab takes over this process (and its id)


def test(args: list[str]) -> int:
    """Unit tests, browser tests and every source notebook under nbval, in one pytest run."""
    notebooks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "course").glob("[0-9][0-9]_*.ipynb"))
    cmd = [str(PYTHON), "-m", "pytest", "-p", "no:cacheprovider", "--nbval-lax",
           "--nbval-cell-timeout=600", "tests", *notebooks, *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT).returncode


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("lab", "test"):
        print(__doc__)
        return 2
    command, rest = sys.argv[1], sys.argv[2:]
    setup()
    if command == "lab":
        lab(rest)
        return 0
    return test(rest)


if __name__ == "__main__":
    sys.exit(main())
