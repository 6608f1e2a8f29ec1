"""All-reduce written out with point-to-point sends: the naive way, and the ring that DDP relies on.

After backward, every rank of data parallelism holds gradients of S bytes and needs their sum.

- Naive: every rank sends its tensor to one root, the root adds them and sends the sum back. The
  root sends and receives (N-1)·S bytes each: its link is the bottleneck and grows with N.
- Ring (Patarasuk & Yuan 2009; Baidu's allreduce 2017): split the tensor in N chunks. In N-1
  steps of reduce-scatter each rank passes one chunk to its right neighbour and adds the chunk that
  arrives from its left; then every rank owns one fully summed chunk. N-1 steps of all-gather pass
  the summed chunks around the ring. Every rank sends 2(N-1)/N·S bytes, under 2·S whatever N is.

Example (inside a rank started by `companion.launch.run`):
    >>> traffic = Traffic()
    >>> grad = torch.randn(1000)
    >>> ring_all_reduce(grad, stats=traffic)          # doctest: +SKIP
    >>> traffic.sent_bytes                             # 2·(N-1)/N · 4000 bytes

The two halves of the ring are collectives of their own, the ones ZeRO (chapter 07) is built on:
`ring_reduce_scatter` leaves rank r with the sum of chunk r only, `ring_all_gather` gives every rank
every rank's chunk. Each sends (N-1)/N·S bytes per rank.

Simplified vs PyTorch: gloo and NCCL pipeline each step in smaller pieces, pick ring or tree by
size, and run on dedicated streams; here each step is one send and one receive of whole chunks,
posted together (`batch_isend_irecv`, which NCCL needs to pair them).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

__all__ = ["Traffic", "naive_all_reduce", "ring_all_reduce", "ring_bytes_per_rank",
           "naive_root_bytes", "time_all_reduce", "ring_reduce_scatter", "ring_all_gather",
           "shard_bytes_per_rank"]


@dataclasses.dataclass
class Traffic:
    """Bytes and messages one rank sent and received."""

    sent_bytes: int = 0
    received_bytes: int = 0
    messages: int = 0


def ring_bytes_per_rank(nbytes: int, world_size: int) -> float:
    """The ring's traffic per rank: 2(N-1)/N · S bytes sent (and as many received)."""
    return 2 * (world_size - 1) / world_size * nbytes


def naive_root_bytes(nbytes: int, world_size: int) -> int:
    """The naive all-reduce's load on its root: (N-1)·S bytes sent (and as many received)."""
    return (world_size - 1) * nbytes


def shard_bytes_per_rank(nbytes: int, world_size: int) -> float:
    """A ring reduce-scatter's (or all-gather's) traffic per rank for a full tensor of S bytes:
    (N-1)/N · S sent (and as many received), half an all-reduce."""
    return (world_size - 1) / world_size * nbytes


def _peer(group, group_rank: int) -> int:
    """The global rank of `group_rank` in `group` (send/recv address global ranks)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _send(chunk: torch.Tensor, dst: int, group, stats: Traffic | None):
    """Start sending `chunk` (returns the request to wait on); count its bytes."""
    if stats is not None:
        stats.sent_bytes += chunk.numel() * chunk.element_size()
        stats.messages += 1
    return dist.isend(chunk, dst, group=group)                            # point-to-point


def _recv(buffer: torch.Tensor, src: int, group, stats: Traffic | None) -> None:
    dist.recv(buffer, src, group=group)                                   # point-to-point, blocks
    if stats is not None:
        stats.received_bytes += buffer.numel() * buffer.element_size()


def naive_all_reduce(tensor: torch.Tensor, group=None, *, stats: Traffic | None = None) -> None:
    """Sum `tensor` over all ranks, in place: gather to rank 0, add there, send the sum back.

    Traffic: rank 0 receives and sends (N-1)·S bytes; the others send and receive S.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return
    if rank != 0:
        _send(tensor.contiguous(), _peer(group, 0), group, stats).wait()  # 1. send mine to root
        result = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        _recv(result, _peer(group, 0), group, stats)                      # 4. receive the sum
        tensor.copy_(result)
        return
    total = tensor.clone(memory_format=torch.contiguous_format)
    buffer = torch.empty_like(total)
    for src in range(1, world):                                           # 2. gather, one by one
        _recv(buffer, _peer(group, src), group, stats)
        total += buffer                                                   # 3. reduce on the root
    requests = [_send(total, _peer(group, dst), group, stats) for dst in range(1, world)]
    for request in requests:                                              # 4. send the sum back
        request.wait()
    tensor.copy_(total)


def ring_all_reduce(tensor: torch.Tensor, group=None, *, stats: Traffic | None = None) -> None:
    """Sum `tensor` over all ranks, in place: reduce-scatter, then all-gather, around a ring.

    Rank r sends to r+1 and receives from r-1. Chunk sizes come from `tensor_split`, so any length
    works (chunks differ by at most one element; empty chunks are skipped on both sides).
    Traffic per rank: 2(N-1)/N·S bytes sent, as many received.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:
        return
    contiguous = tensor.is_contiguous()
    flat = tensor.detach().view(-1) if contiguous else tensor.detach().reshape(-1).clone()
    chunks = list(torch.tensor_split(flat, world))                        # N views of flat
    right, left = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    spare = torch.empty_like(chunks[0])                                   # (ceil(numel/N),)
    for step in range(world - 1):                                         # 1. reduce-scatter
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        buffer = spare[:chunks[recv_i].numel()]
        _exchange(chunks[send_i], right, buffer, left, group, stats)
        chunks[recv_i] += buffer              # after step s, chunk r-s-1 holds s+2 ranks' sum
    for step in range(world - 1):                                         # 2. all-gather
        send_i, recv_i = (rank + 1 - step) % world, (rank - step) % world
        _exchange(chunks[send_i], right, chunks[recv_i], left, group, stats)
    if not contiguous:
        tensor.copy_(flat.view_as(tensor))


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group,
              stats: Traffic | None) -> None:
    """Send `send` to dst while receiving into `recv` from src (skipping empty chunks).

    The send and the receive are posted together (`batch_isend_irecv`): NCCL runs point-to-point
    operations of one stream in order, so a send posted alone on every rank would wait for a
    receive that no rank has posted yet, and the ring would deadlock (gloo would not)."""
    ops = []
    if send.numel():
        if stats is not None:
            stats.sent_bytes += send.numel() * send.element_size()
            stats.messages += 1
        ops.append(dist.P2POp(dist.isend, send, dst, group=group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group=group))
    for request in dist.batch_isend_irecv(ops) if ops else []:    # point-to-point, together
        request.wait()
    if recv.numel() and stats is not None:
        stats.received_bytes += recv.numel() * recv.element_size()


def _equal_chunks(full: torch.Tensor, shard: torch.Tensor, world: int) -> list[torch.Tensor]:
    """`full` (flat, contiguous) as N chunks of shard's size, or a ValueError saying why not."""
    if full.dim() != 1 or not full.is_contiguous() or not shard.is_contiguous():
        raise ValueError("the full tensor must be flat (1-D) and contiguous, the shard contiguous")
    if full.numel() != world * shard.numel() or full.dtype != shard.dtype:
        raise ValueError(f"the full tensor must hold world_size x shard elements of one dtype: "
                         f"{full.numel()} {full.dtype} against {world} x {shard.numel()} "
                         f"{shard.dtype}; pad it to a multiple of the world size")
    return list(full.view(world, -1))


def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *,
                        stats: Traffic | None = None) -> None:
    """Sum `input` (flat, N·s elements) over ranks and leave chunk r of the sum in rank r's
    `output` (s elements), around a ring. `input` is left as it was; `output` may be a view of
    input's chunk r (in place, as NCCL allows). Traffic per rank: (N-1)·s elements, (N-1)/N·S.

    Step k (k = 0..N-2): send the running sum of chunk (r-k-1) % N to the right, receive the left
    neighbour's running sum of chunk (r-k-2) % N and add our own part of it. After N-2 steps the
    chunk that arrives is (r-N) % N = r, summed over all N ranks.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunks = _equal_chunks(input, output, world)
    if world == 1:
        output.copy_(chunks[0])
        return
    right, left = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    sending = chunks[(rank - 1) % world]                                  # (s,) our own part
    arriving = [torch.empty_like(output), torch.empty_like(output)]       # 2 x s spare
    for step in range(world - 1):
        buffer = arriving[step % 2]            # never the one still being sent
        _exchange(sending, right, buffer, left, group, stats)
        buffer += chunks[(rank - step - 2) % world]                       # add our part
        sending = buffer
    output.copy_(sending)


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, *,
                    stats: Traffic | None = None) -> None:
    """Concatenate every rank's `input` (s elements) in rank order into `output` (flat, N·s), on
    every rank, around a ring. `input` may be a view of output's chunk r (in place).
    Traffic per rank: (N-1)·s elements, (N-1)/N·S.

    Step k: send chunk (r-k) % N to the right, receive chunk (r-k-1) % N from the left.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    chunks = _equal_chunks(output, input, world)
    chunks[rank].copy_(input)
    right, left = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    for step in range(world - 1):
        _exchange(chunks[(rank - step) % world], right, chunks[(rank - step - 1) % world], left,
                  group, stats)


def time_all_reduce(rank: int, world_size: int, impl: str, numel: int,
                    repeats: int = 3) -> tuple[float, Traffic]:
    """A worker for `launch.run`: best seconds of `repeats` all-reduces of `numel` float32, and
    one call's traffic. impl: "ring", "naive" (ours) or "gloo" (dist.all_reduce)."""
    run = {"ring": ring_all_reduce, "naive": naive_all_reduce}.get(impl)
    from companion.cost.clock import now                 # companion.cost imports this module
    from companion.launch import rank_device
    device = rank_device()
    tensor = torch.ones(numel, device=device)                             # 4·numel bytes
    best, traffic = float("inf"), Traffic()
    for i in range(repeats + 1):                                          # +1: a warm-up call
        dist.barrier()                                                    # start together
        start = now(device)                                               # host-device sync
        if run is None:
            dist.all_reduce(tensor)
        else:
            run(tensor, stats=traffic if i == 0 else None)
        if i:
            best = min(best, now(device) - start)                         # host-device sync
    return best, traffic
