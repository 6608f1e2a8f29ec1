"""The guard that chapter 06's ring all-reduce and chapter 07's ring reduce-scatter checks run a
learner's answer under, inside each gloo worker: only point-to-point calls go through, and every
send is logged with its destination and bytes, so a check can hold the answer to a ring's traffic.

An allowlist: every public function of torch.distributed that is not a send, a receive, a barrier
or a query (get_*, is_*) raises, under both `dist.NAME` and `distributed_c10d.NAME` (so
`all_to_all_single`, `all_gather_object` or `distributed_c10d.all_reduce` cannot slip through).
What bypasses the Python API (a ProcessGroup's own methods) moves no logged bytes, which the exact
byte count then catches.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable, Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["point_to_point_only", "ring_direction"]

_SENDS = ("send", "isend")
_ALLOWED = ("recv", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
            "supports_complex", "GroupName")


def _communicating() -> list[str]:
    """Public torch.distributed functions that the guard refuses: all but the allowlist."""
    names = []
    for name in c10d.__all__:
        fn = getattr(c10d, name, None)
        if (callable(fn) and not inspect.isclass(fn) and name not in _ALLOWED + _SENDS
                and not name.startswith(("get_", "is_"))):
            names.append(name)
    return names


def _refuse(name: str) -> Callable:
    def refuse(*args, **kwargs):
        raise RuntimeError(f"dist.{name} is a collective (or not a point-to-point call): build "
                           "the ring from dist.isend / dist.irecv / dist.send / dist.recv only")
    return refuse


class _SendLog:
    """send and isend, wrapped: each call the answer makes appends (destination, bytes) to `log`.
    A send made inside one of them goes straight through: in recent torch (2.13) dist.send
    calls isend, then wait(), and counting that isend too would double every blocking send."""

    def __init__(self, log: list[tuple[int, int]]):
        self.log, self.inside = log, False

    def wrap(self, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def send(*args, **kwargs):
            if self.inside:
                return original(*args, **kwargs)
            try:
                bound = signature.bind(*args, **kwargs).arguments
            except TypeError:                           # let torch say what is wrong
                return original(*args, **kwargs)
            dst, tensor = bound.get("dst"), bound["tensor"]
            self.log.append((dst if dst is not None else bound.get("group_dst"),
                             tensor.numel() * tensor.element_size()))
            self.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self.inside = False
        return send


@contextlib.contextmanager
def point_to_point_only(log: list[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
    """Inside, every torch.distributed call but send/isend/recv/irecv/batch_isend_irecv, barriers
    and queries raises; each send or isend the caller makes appends (destination, bytes) to `log`.

        log = []
        with point_to_point_only(log):
            answer(tensor)
        sum(b for _, b in log)          # bytes this rank sent
    """
    sends = _SendLog(log)
    replaced = {name: _refuse(name) for name in _communicating()}
    replaced.update({name: sends.wrap(getattr(c10d, name)) for name in _SENDS})
    saved = [(module, name, getattr(module, name)) for module in (dist, c10d)
             for name in replaced if hasattr(module, name)]
    for module, name, _ in saved:        # c10d too: P2POp compares ops to c10d.isend / irecv
        setattr(module, name, replaced[name])
    try:
        yield log
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def ring_direction(log: list[tuple[int, int]], rank: int, world: int) -> int | None:
    """+1 if every logged send went to the right neighbour (rank+1) % N, -1 if every one went to
    the left (rank-1) % N, None otherwise (or if nothing was sent)."""
    peers = {peer for peer, _ in log}
    for step in (1, -1):
        if peers == {(rank + step) % world}:
            return step
    return None
