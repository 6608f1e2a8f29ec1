"""Start a chapter: the one call every notebook's first cell makes, and progress for long cells.

A JupyterLab kernel does not inherit the one thread `tasks.py test` gives CI, so each chapter used
to choose (or forget to choose) its own. With torch's default, one OpenMP thread per core, a busy
2-core laptop ran chapter 11's training cell 7-11x slower than with one thread: the threads of one
operator wait for each other while the browser and other programs hold the cores. `start()` picks
the threads from the cores this process may use and the load on them, seeds every generator the
chapters draw from, picks the device and its experiment sizes, and sets one plotting style.

Example:
    >>> device, S = start()            # prints what it chose, e.g. "cpu ... | 1 of 2 threads"
    >>> for step in progress(range(100), desc="training"):
    ...     pass                       # a bar, with the time the rest will take
"""
from __future__ import annotations

import math
import os
import pathlib
import random
import time
from collections.abc import Iterable, Iterator

import torch

from companion.device import Sizes, describe, pick_device, sizes

__all__ = ["start", "usable_cores", "choose_threads", "plot_style", "progress"]

_CGROUP_V2 = pathlib.Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = pathlib.Path("/sys/fs/cgroup/cpu")
_SELF_CGROUP = pathlib.Path("/proc/self/cgroup")
_CPUS = pathlib.Path("/sys/devices/system/cpu")
MAX_THREADS = 4        # the course's models are small: past 4 threads nothing runs faster


def _cgroup_cores() -> float | None:
    """The CPU quota of this process's cgroup in cores (a container limited to 1.5 CPUs: 1.5), or
    None where there is no quota or no cgroup file to read (macOS, Windows, no limit). cgroup v2
    reads this process's own group (a systemd slice, a container) before the root's."""
    try:
        own = [line.split("::", 1)[1] for line in _SELF_CGROUP.read_text().splitlines()
               if line.startswith("0::")]
    except OSError:
        own = []
    try:
        mine = [_CGROUP_V2.parent / own[0].lstrip("/") / "cpu.max"] if own else []
        for path in mine + [_CGROUP_V2]:
            if path.exists():
                quota, period = path.read_text().split()[:2]
                return None if quota == "max" else int(quota) / int(period)
        quota = int((_CGROUP_V1 / "cpu.cfs_quota_us").read_text())
        period = int((_CGROUP_V1 / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def _physical(cpus: set[int]) -> int | None:
    """How many physical cores the logical CPUs `cpus` sit on (two hyper-threads of one core count
    once), from Linux's topology files, else psutil's count; None where neither answers."""
    try:
        cores = {((_CPUS / f"cpu{c}" / "topology" / "physical_package_id").read_text().strip(),
                  (_CPUS / f"cpu{c}" / "topology" / "core_id").read_text().strip()) for c in cpus}
        return len(cores)
    except OSError:
        pass
    try:
        import psutil
        return psutil.cpu_count(logical=False)
    except (ImportError, AttributeError):
        return None


def usable_cores() -> int:
    """The physical cores this process may run on: those under its CPU affinity (or the machine's),
    lowered to a container's CPU quota when there is one."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(
        range(os.cpu_count() or 1))
    cores = min(len(cpus), _physical(cpus) or len(cpus))
    quota = _cgroup_cores()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def choose_threads(cores: int, load: float) -> int:
    """The intra-op threads for the course's CPU work on `cores` physical cores with a 1-minute load
    average of `load`: half the cores at most (the kernel, the browser and the rest of the machine
    keep the others), no more than the cores left idle, less one, and MAX_THREADS at most; never
    fewer than one.

    The course's models are small: a second thread saves little on a quiet machine and costs 7-11x
    on a busy one, so on 2 cores (a laptop's 2 cores with 4 hyper-threads too) this is always 1.
    """
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be a positive int, got {cores!r}")
    if not isinstance(load, (int, float)) or math.isnan(load) or load < 0:
        raise ValueError(f"load must be a non-negative number, got {load!r}")
    idle = cores - load
    return max(1, min(cores // 2, math.floor(idle) - 1, MAX_THREADS))


def _load() -> float:
    """The 1-minute load average (psutil's estimate on Windows), or 0 where none is known. It is
    read once, when the chapter starts: a machine that gets busier later keeps the count."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        pass
    try:
        import psutil
        return psutil.getloadavg()[0]
    except (ImportError, AttributeError, OSError):
        return 0.0


def plot_style() -> None:
    """One look for every chapter's plots: a light grid, no top and right spines, and lines that
    differ in dash as well as colour, so a curve drawn on top of another still shows."""
    import matplotlib as mpl
    from cycler import cycler

    colors = mpl.colormaps["tab10"].colors[:8]
    mpl.rcParams.update({
        "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False,
        "axes.spines.right": False, "figure.dpi": 100, "legend.framealpha": 0.8,
        "axes.prop_cycle": cycler(color=colors) + cycler(linestyle=["-", "--", ":", "-."] * 2),
    })


def start(chapter: str | None = None, *, seed: int = 0, device: str | torch.device | None = None,
          threads: int | None = None, quiet: bool = False) -> tuple[torch.device, Sizes]:
    """Set up a chapter's kernel and return `(device, S)`: the device to run on and its sizes.

    1. Threads: `threads` if given; else a count you set yourself (OMP_NUM_THREADS, as `tasks.py
       test` does) is kept; else `choose_threads(usable_cores(), load)`.
    2. Seeds Python's `random` and torch (every device) with `seed`.
    3. The device (`pick_device(device)`: CUDA when present) and its sizes (`device.sizes`).
    4. The plotting style (`plot_style`).
    It prints one line saying what it chose, unless `quiet`, and for `chapter` ("05") which
    recorded GPU runs ship with the course (`results.recorded`): none yet, or their GPUs.
    """
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or threads < 1):
        raise ValueError(f"threads must be a positive int or None, got {threads!r}")
    cores, load = usable_cores(), _load()
    if threads is None and "OMP_NUM_THREADS" not in os.environ:
        threads = choose_threads(cores, load)
    if threads is not None:
        torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)
    device = pick_device(device)
    plot_style()
    if not quiet:
        print(f"{device.type} ({describe(device)['name']}) | torch {torch.__version__} | "
              f"{torch.get_num_threads()} thread(s) on {cores} core(s), load {load:.1f} | "
              f"seed {seed}")
        if chapter is not None:
            print(_recorded_line(chapter))
    return device, sizes(device)


def _recorded_line(chapter: str) -> str:
    """Which recorded GPU runs the chapter's last section will show beside this machine's."""
    from companion.results import recorded

    runs = recorded(chapter)
    if not runs:
        return (f"Recorded GPU runs for chapter {chapter}: none ships with the course yet, so its "
                "last section shows only your numbers.")
    return (f"Recorded GPU runs for chapter {chapter}: "
            + ", ".join(f"{run['machine']} ({run['date']})" for run in runs)
            + "; the chapter's last section sets them beside your numbers.")


def progress(items: Iterable, *, desc: str, total: int | None = None) -> Iterator:
    """Iterate over `items` behind a progress bar (tqdm) that says, once the first item is done,
    how long the whole loop will take on this machine at that pace."""
    from tqdm.auto import tqdm

    total = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
    bar = tqdm(items, desc=desc, total=total)
    began = time.perf_counter()          # host clock: the learner's wait, device work included
    for i, item in enumerate(bar):
        yield item
        if i == 0 and total:
            first = time.perf_counter() - began       # host clock, as above
            bar.set_postfix_str(f"about {first * total:.0f} s in all")
