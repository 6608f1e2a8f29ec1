"""Start N worker processes, each a rank of one torch.distributed process group, and collect results.

Data parallelism needs real processes: one per device, each with its own Python interpreter (no GIL
shared between them), talking through a process group (gloo on CPU, NCCL on GPUs). `run` gives a
notebook cell or a test that setup in one call, and makes failures readable: a rank that raises is
reported by number with its traceback, a rank that hangs is ended at the deadline with the stack it
was stuck in, and no process outlives the call.

Example:
    >>> from companion import launch
    >>> def rank_plus_one(rank, world_size):       # must live in a module the workers can import
    ...     return rank + 1
    >>> launch.run(rank_plus_one, 3)              # doctest: +SKIP
    [1, 2, 3]

In a notebook, functions defined in a cell live in `__main__`, which worker processes cannot import.
Write the cell to a module instead: `%load_ext companion.launch` once, then start a cell with
`%%worker_module my_module`; the cell's functions are then importable by every rank.

Workers start from Python's fork server, which imports torch once: the first `run` takes about a
second, later ones a fraction of that. Each rank runs single-threaded by default so that N ranks on
a small CPU do not fight over cores.

Simplified vs PyTorch: `torch.multiprocessing.spawn` and `torchrun` also restart failed workers
(elastic), set up NCCL environment details and read MASTER_ADDR/MASTER_PORT; here the rendezvous is a
TCPStore that this process hosts on a free 127.0.0.1 port, so runs on one machine never collide.
"""
from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.util
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["run", "WorkerError", "WorkerTimeout", "pick_backend", "rank_device",
           "load_ipython_extension"]

_CONTEXT = "forkserver"
_PRELOAD = ["torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.nn.parallel",
            "companion.launch"]  # imported once by the fork server; optimizers import _dynamo


class WorkerError(RuntimeError):
    """A rank raised. `.rank` is its number, `.traceback` the worker's traceback as text."""

    def __init__(self, rank: int, tb: str, *, output: str = ""):
        self.rank, self.traceback, self.output = rank, tb, output
        last = tb.strip().splitlines()[-1] if tb.strip() else "it exited without a result"
        super().__init__(f"rank {rank} failed: {last}\n\n--- traceback of rank {rank} ---\n{tb}")


class WorkerTimeout(TimeoutError):
    """Ranks still ran at the deadline. `.ranks` lists them; `.stacks` maps rank -> where it was."""

    def __init__(self, ranks: list[int], timeout: float, stacks: dict[int, str]):
        self.ranks, self.stacks = ranks, stacks
        where = "\n".join(f"--- rank {r} was here (most recent call first) ---\n{s}"
                          for r, s in stacks.items() if s)
        super().__init__(f"rank(s) {ranks} still running after {timeout:g} s and were ended: a "
                         "collective or recv that the other ranks never matched?\n" + where)


def rank_device() -> torch.device:
    """Inside a rank: its GPU under NCCL (`run` gives each rank its own), else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pick_backend(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, gloo otherwise."""
    if dist.is_nccl_available() and torch.cuda.is_available() and \
            torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def run(fn: Callable[..., Any], world_size: int, *args, backend: str | None = None,
        timeout: float = 60.0, threads_per_rank: int = 1) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` processes; return the results by rank.

    `fn` and `args` must pickle (fn defined in an importable module). Tensors in `args` are copied
    to each rank, never shared. Raises `WorkerError` naming the first rank that raised (every
    other rank is then ended), or `WorkerTimeout` after `timeout` seconds.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    payload = _pickle_job(fn, args)
    backend = backend or pick_backend(world_size)
    for attempt in range(_SETUP_ATTEMPTS):
        try:
            return _launch(payload, world_size, backend, timeout, threads_per_rank)
        except _SetupError:
            if attempt == _SETUP_ATTEMPTS - 1:  # joining the group failed each time: say so
                raise


# Joining the process group can fail for reasons outside the job (gloo's connectFullMesh loses a
# connection on a loaded machine): no rank has run fn yet, so the launch is retried, on a new port.
_SETUP_ATTEMPTS = 3


class _SetupError(WorkerError):
    """A rank failed while joining the process group, before fn started."""


def _launch(payload: bytes, world_size: int, backend: str, timeout: float,
            threads_per_rank: int) -> list[Any]:
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    ctx = multiprocessing.get_context(_CONTEXT)
    with contextlib.suppress(ValueError, AttributeError):
        ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="companion-launch-") as stacks_dir:
        setup = (store.port, world_size, backend, timeout, threads_per_rank, stacks_dir)
        procs, conns = [], []
        try:
            for rank in range(world_size):
                here, there = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, args=(rank, setup, payload, there), daemon=True,
                                   name=f"companion-rank-{rank}")
                proc.start()
                there.close()
                procs.append(proc)
                conns.append(here)
            return _collect(procs, conns, timeout, stacks_dir)
        finally:
            _end_all(procs)
            for conn in conns:
                conn.close()


def _pickle_job(fn: Callable, args: tuple) -> bytes:
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    try:
        return pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"cannot send {getattr(fn, '__qualname__', fn)!r} or its arguments to worker processes "
            f"({e}). Workers import functions by module and name: define fn in a module (in a "
            "notebook: %load_ext companion.launch, then start the cell with %%worker_module NAME); "
            "lambdas and functions defined inside other functions cannot be sent.") from None


def _collect(procs: list, conns: list, timeout: float, stacks_dir: str) -> list[Any]:
    """Wait for every rank's message (or its death) until the deadline."""
    results: dict[int, Any] = {}
    pending = {conns[r]: r for r in range(len(procs))} | {procs[r].sentinel: r
                                                          for r in range(len(procs))}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        left = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(pending), timeout=max(left, 0))
        if not ready:
            running = sorted(r for r in range(len(procs)) if r not in results)
            raise WorkerTimeout(running, timeout, _dump_stacks(procs, running, stacks_dir))
        for obj in ready:
            rank = pending.pop(obj)
            if obj is procs[rank].sentinel:
                if rank not in results and not conns[rank].poll():
                    raise WorkerError(rank, f"process exited with code {procs[rank].exitcode} "
                                            "before sending a result (killed, or os._exit?)")
                continue
            try:
                kind, body, output = conns[rank].recv()
            except EOFError:
                pending.pop(procs[rank].sentinel, None)
                raise WorkerError(rank, "the process closed its pipe without a result") from None
            _echo(rank, output)
            if kind == "setup-error":
                raise _SetupError(rank, body, output=output)
            if kind == "error":
                raise WorkerError(rank, body, output=output)
            results[rank] = pickle.loads(body)
    return [results[r] for r in range(len(procs))]


def _echo(rank: int, output: str) -> None:
    for line in output.splitlines():
        print(f"[rank {rank}] {line}")


def _dump_stacks(procs: list, ranks: list[int], stacks_dir: str) -> dict[int, str]:
    """Ask hung ranks to write their Python stacks (faulthandler on SIGUSR1), then read them."""
    for r in ranks:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(0.3)
    stacks = {}
    for r in ranks:
        with contextlib.suppress(OSError):
            with open(os.path.join(stacks_dir, f"rank{r}.txt")) as f:
                stacks[r] = _main_stack(f.read())
    return stacks


def _main_stack(dump: str) -> str:
    """From a faulthandler dump of all threads, the frames of fn: the thread inside `_worker`."""
    for block in dump.split("\n\n"):
        lines = block.strip().splitlines()
        if any("in _worker" in line for line in lines):
            frames = lines[1:[i for i, ln in enumerate(lines) if "in _worker" in ln][0]]
            return "\n".join(frames) or block.strip()
    return dump.strip()


def _end_all(procs: list) -> None:
    """Terminate, then kill, every rank still alive; reap them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def _worker(rank: int, setup: tuple, payload: bytes, conn) -> None:
    """The body of each rank: join the group, run fn, send back ("ok"|"error", body, output)."""
    port, world_size, backend, timeout, threads, stacks_dir = setup
    stacks = open(os.path.join(stacks_dir, f"rank{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    threading.Timer(timeout + 10.0, os._exit, args=(3,)).start()  # never outlive the caller
    torch.set_num_threads(threads)
    out = io.StringIO()
    kind = "error"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            fn, args = pickle.loads(payload)
            kind = "setup-error"               # until the group is joined
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=timedelta(seconds=timeout))
            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                     timeout=timedelta(seconds=timeout))
            kind = "error"
            result = fn(rank, world_size, *args)
            message = ("ok", pickle.dumps(result), out.getvalue())
    except BaseException:
        message = (kind, traceback.format_exc(), out.getvalue())
    conn.send(message)
    conn.close()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    os._exit(0)


# ---------------------------------------------------------------- notebooks: %%worker_module

def _worker_module(line: str, cell: str, folder: str) -> None:
    """Write the cell to `<folder>/<name>.py`, (re)import it, and bind its public names here."""
    from IPython import get_ipython
    name = line.strip()
    if not name.isidentifier():
        raise ValueError(f"usage: %%worker_module NAME (a Python identifier), got {line!r}")
    path = os.path.join(folder, f"{name}.py")
    with open(path, "w") as f:
        f.write(cell)
    with contextlib.suppress(OSError):       # a rewrite within the same second must not reuse it
        os.remove(importlib.util.cache_from_source(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)        # spawned/forked workers receive the parent's sys.path
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    module = importlib.import_module(name)
    public = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    get_ipython().user_ns.update(public)


def load_ipython_extension(ipython) -> None:
    """`%load_ext companion.launch` registers the cell magic `%%worker_module NAME`."""
    folder = tempfile.mkdtemp(prefix="companion-workers-")
    ipython.register_magic_function(lambda line, cell: _worker_module(line, cell, folder),
                                    magic_kind="cell", magic_name="worker_module")
