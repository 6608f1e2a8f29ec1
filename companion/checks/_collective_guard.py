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


def _logged(original: Callable, log: list[tuple[int, int]]) -> Callable:
    def send(tensor, dst=None, *args, group_dst=None, **kwargs):
        peer = dst if dst is not None else group_dst
        log.append((peer, tensor.numel() * tensor.element_size()))      # (destination, bytes)
        return original(tensor, dst, *args, group_dst=group_dst, **kwargs)
    return send


@contextlib.contextmanager
def point_to_point_only(log: list[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
    """Inside, every torch.distributed call but send/isend/recv/irecv/batch_isend_irecv, barriers
    and queries raises; each send or isend appends (destination, bytes) to `log`.

        log = []
        with point_to_point_only(log):
            answer(tensor)
        sum(b for _, b in log)          # bytes this rank sent
    """
    replaced = {name: _refuse(name) for name in _communicating()}
    replaced.update({name: _logged(getattr(c10d, name), log) for name in _SENDS})
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
