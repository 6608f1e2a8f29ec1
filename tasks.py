#!/usr/bin/env python3
"""Set up the course and run it: the two commands of the README, and a reset.

    python3 tasks.py lab         # set up, create your workbook, open it in JupyterLab
    python3 tasks.py test        # set up, run the unit tests and execute every notebook under nbval
    python3 tasks.py reset 01    # a fresh workbook for chapter 01; the old one is kept as a backup
    python3 tasks.py gpu         # on a GPU machine: record every chapter (no setup, no pip)

`test` includes the browser tests in tests/browser (JupyterLab driven by Chromium), which are
skipped, with the reason, where /usr/bin/chromium is missing.

Setup makes a virtual environment in .venv, installs PyTorch there if it has none (a torch you
installed yourself, e.g. a CUDA build, is kept; setup says so when its version is not TORCH's),
then the companion package: `lab` and `reset` with what the course needs (Triton too, on Linux
x86_64, for chapter 10's kernels), `test` also with the test tools (pytest, hypothesis,
Playwright, PEFT, bitsandbytes). Every command is safe to re-run; the second time, setup only
checks that nothing changed.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import venv

ROOT = pathlib.Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".setup-stamp"
TORCH = "torch==2.13.0"         # the notebooks' stored outputs were made with it; README pins it
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")


def _run(*cmd: object) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def _say(step: str) -> None:
    print(f"\n== {step}", flush=True)


def _has(*modules: str) -> bool:
    return subprocess.run([str(PYTHON), "-c", f"import {', '.join(modules)}"], cwd=ROOT,
                          capture_output=True).returncode == 0


def _torch_version() -> str | None:
    """The version of the torch installed in .venv ("2.13.0+cpu"), or None if there is none."""
    code = "import importlib.metadata as m; print(m.version('torch'))"
    done = subprocess.run([str(PYTHON), "-c", code], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def _torch_kept(version: str) -> None:
    """Say that the torch in .venv is kept, and how to switch when it is not TORCH's version."""
    _say(f"2/3 PyTorch {version} is already in .venv: kept as it is")
    wanted = TORCH.split("==")[1]
    if version.split("+")[0] != wanted:
        pip = f"{VENV.name}/{BIN.name}/pip install {TORCH}"
        print(f"   The notebooks' stored outputs were made with PyTorch {wanted}. To switch, run\n"
              f"   {pip} with the --index-url the README gives for your hardware.", flush=True)


def _torch_note() -> None:
    """On Linux without an NVIDIA driver, say what PyPI's default torch wheel will download."""
    if platform.system() == "Linux" and shutil.which("nvidia-smi") is None:
        print("   No NVIDIA GPU found. On Linux, PyPI's torch wheel bundles the CUDA libraries\n"
              "   (several GB). If this download is not served from a local cache, stop now\n"
              "   (Ctrl+C) and install the CPU build first, as the README says:\n"
              f"   .venv/bin/pip install {TORCH} --index-url https://download.pytorch.org/whl/cpu",
              flush=True)


def setup(*, dev: bool) -> None:
    """Create .venv and install what the course needs (`dev`: and the test tools), skipping what
    is already done. Each step says what it does; pip shows its own progress."""
    if sys.version_info < (3, 10):
        sys.exit(f"Python 3.10 or newer is needed; this is {sys.version.split()[0]}.")
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    done = STAMP.read_text().split() if STAMP.exists() else []
    if done[:1] == [wanted] and ("dev" in done or not dev) and _has("torch", "companion"):
        return
    if not PYTHON.exists():
        _say(f"1/3 creating the virtual environment {VENV.name}/")
        venv.create(VENV, with_pip=True)
    pip = [PYTHON, "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "on"]
    version = _torch_version()
    if version is not None:
        _torch_kept(version)
    else:
        _say(f"2/3 installing PyTorch ({TORCH}): the CPU build is a 190 MB download (750 MB\n"
             "   installed); a CUDA build is several GB")
        _torch_note()
        _run(*pip, TORCH)
    extras = "[dev]" if dev else ""
    _say("3/3 installing the course's packages (JupyterLab, ipywidgets, matplotlib, nbval,\n"
         "   Triton on Linux: about 250 MB to download, 1 GB installed"
         + (", and the test tools: pytest, hypothesis, Playwright, PEFT, bitsandbytes)" if dev
            else ")"))
    _run(*pip, "-e", f"{ROOT}{extras}")
    STAMP.write_text(f"{wanted} {'dev' if dev else 'course'}")
    _say("setup done")


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
    """Unit tests, browser tests and every source notebook under nbval, in one pytest run, spread
    over up to 4 worker processes (pytest-xdist): a notebook, a browser notebook run and a test
    file each stay on one worker (see conftest.py)."""
    notebooks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "course").glob("[0-9][0-9]_*.ipynb"))
    workers = max(1, min(4, os.cpu_count() or 1))
    cmd = [str(PYTHON), "-m", "pytest", "-p", "no:cacheprovider", "--nbval-lax",
           "--nbval-cell-timeout=600", "-n", str(workers), "--dist", "loadgroup", "--durations=25",
           "tests", *notebooks, *args]
    # One thread per worker process and per kernel: N workers that each spin N threads on N cores
    # make small steps 10-50x slower (OpenMP threads busy-wait for each other).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def reset(args: list[str]) -> int:
    """Replace chapters' workbooks by fresh ones, keeping each old file in workbook/backups/."""
    if not args:
        print("usage: python3 tasks.py reset NN [NN ...]   (e.g. reset 01)", file=sys.stderr)
        return 2
    return subprocess.run([str(PYTHON), "-m", "companion", "reset", *args], cwd=ROOT).returncode


def gpu(args: list[str]) -> int:
    """The whole GPU session (`python -m companion record --session`) with the Python that runs
    this script and the package from this folder: no virtual environment, no setup, no pip, so it
    runs on a machine with no network and no Jupyter. Extra arguments go to the session
    (`--budget-seconds 300`, `--chapters 04 05`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                      os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "companion", "record", "--session", *args]
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("lab", "test", "reset", "gpu"):
        print(__doc__)
        return 2
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "gpu":
        return gpu(rest)                  # before setup: a GPU machine has no network
    setup(dev=command == "test")
    if command == "lab":
        lab(rest)
        return 0
    return reset(rest) if command == "reset" else test(rest)


if __name__ == "__main__":
    sys.exit(main())
