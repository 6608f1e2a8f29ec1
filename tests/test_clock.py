"""companion.cost.clock: every timer of the package waits for the device on both ends."""
import pathlib
import time

import torch

from companion.cost import clock

PACKAGE = pathlib.Path(clock.__file__).resolve().parents[1]
# Wall-clock limits on a learner's code (the grader, the checks) time the host, by design.
HOST_ONLY = ("grader/", "grading.py", "checks/")


def test_no_module_reads_the_clock_without_waiting_for_the_device():
    """A CUDA timer read right after a call times the launch. Device work is timed with
    `clock.now` / `Stopwatch` (a sync first); a raw read must say it times the host."""
    raw = []
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE))
        if name == "cost/clock.py" or name.startswith(HOST_ONLY):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if "perf_counter()" in line and "host clock" not in line:
                raw.append(f"{name}:{number}: {line.strip()}")
    assert raw == [], "time device work with companion.cost.clock.now:\n" + "\n".join(raw)


def test_the_stopwatch_synchronizes_before_each_reading_of_the_clock(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    real = time.perf_counter
    monkeypatch.setattr(clock.time, "perf_counter", lambda: events.append("clock") or real())
    with clock.Stopwatch("cuda:0") as watch:
        events.append("work")
    assert events == ["sync", "clock", "work", "sync", "clock"] and watch.seconds >= 0
    events.clear()
    with clock.Stopwatch("cpu"):
        events.append("work")
    assert events == ["clock", "work", "clock"]                  # nothing to wait for on a CPU


def test_no_device_means_every_gpu(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    clock.synchronize(None)                                      # DataParallel's phases
    assert synced == [0, 1, 2]
