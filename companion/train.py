"""Train the course GPT on N processes with a chosen set of memory techniques.

`python -m companion train` is the same code the notebooks run, on a real launcher: `torchrun`
starts one process per device and sets RANK, WORLD_SIZE and MASTER_ADDR/PORT, and the processes
meet through `env://` rendezvous (gloo on CPU, NCCL on GPUs; `--nnodes` spans machines). Without
torchrun it runs as a single process. Each rank prints nothing; rank 0 prints one line per rank:
peak memory, model-state bytes, median step time, traffic, and the loss.

    torchrun --nproc_per_node=2 -m companion train --parallel zero3 --accumulation 2 \\
        --checkpointing --precision bf16 --steps 20

Techniques, each with an off switch that does nothing: `--parallel` none | ddp (chapter 06) |
zero1 | zero2 | zero3 (chapter 07), `--accumulation K` micro-batches per step (chapter 03; DDP
skips the all-reduce of the first K-1 with no_sync), `--checkpointing` every transformer block
(chapter 04), `--precision bf16` (autocast; ZeRO-3 gathers and computes in bf16 instead).

Simplified vs a production launcher: no data loader (token sequences are generated per step), no
checkpoint saving or resuming, no learning-rate schedule, no fp16 loss scaling.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import statistics
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from companion import ddp
from companion.memory import format_bytes, track
from companion.models import GPT, make_tokens
from companion.zero import FSDP, ShardedOptimizer
from companion.cost.clock import now

__all__ = ["TrainConfig", "train", "worker", "parse", "main", "report_table", "backend_for"]

PARALLEL = ("none", "ddp", "zero1", "zero2", "zero3")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One run: the model's shape, the batch, and the techniques switched on."""

    parallel: str = "ddp"
    accumulation: int = 1        # micro-batches per optimizer step
    checkpointing: bool = False
    precision: str = "fp32"      # fp32 | bf16
    steps: int = 5
    batch: int = 8               # sequences per rank per optimizer step
    seq_len: int = 64
    width: int = 64
    depth: int = 2
    heads: int = 4
    vocab: int = 128
    lr: float = 1e-3
    seed: int = 0

    def __post_init__(self):
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, "
                             f"got {self.parallel!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")
        if self.accumulation < 1 or self.batch % self.accumulation:
            raise ValueError(f"--batch {self.batch} must split into --accumulation "
                             f"{self.accumulation} equal micro-batches")


class _Checkpointed(nn.Module):
    """The GPT's blocks, each run under activation checkpointing (recomputed in backward)."""

    def __init__(self, blocks: nn.Sequential):
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)   # keeps x, recomputes the rest
        return x


def _setup(config: TrainConfig, device: torch.device):
    """(network to call, optimizer, what to call before step, counters) for config.parallel."""
    model = GPT(config.vocab, config.seq_len, config.width, config.depth, config.heads,
                seed=config.seed, device=device)
    if config.checkpointing:
        model.blocks = _Checkpointed(model.blocks)
    adamw = {"lr": config.lr}
    if config.parallel == "zero3":
        dtype = torch.bfloat16 if config.precision == "bf16" else None
        net = FSDP(model, compute_dtype=dtype)
        return net, torch.optim.AdamW(net.parameters(), **adamw), \
            net.finish_gradient_synchronization, net.comm
    if config.parallel in ("zero1", "zero2"):
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW,
                               stage=int(config.parallel[-1]), **adamw)
        return model, opt, lambda: None, opt.comm
    net = ddp.DDP(model) if config.parallel == "ddp" else model
    finish = net.finish_gradient_synchronization if config.parallel == "ddp" else lambda: None
    return net, torch.optim.AdamW(model.parameters(), **adamw), finish, None


def _micro_batches(config: TrainConfig, step: int, rank: int, world: int, device):
    """This rank's slice of the step's global batch, cut into micro-batches."""
    x, y = make_tokens(world * config.batch, config.seq_len, vocab=config.vocab,
                       seed=config.seed * 100_003 + step)
    mine = slice(rank * config.batch, (rank + 1) * config.batch)
    return list(zip(x[mine].to(device).chunk(config.accumulation),
                    y[mine].to(device).chunk(config.accumulation)))


def _step(config: TrainConfig, net, optimizer, finish, batches, device) -> float:
    """One optimizer step over the micro-batches; returns the mean loss. Gradients are cleared
    first, so the last step's stay in memory to be measured with the other model states."""
    optimizer.zero_grad()
    k, total = len(batches), 0.0
    use_autocast = config.precision == "bf16" and config.parallel != "zero3"
    for i, (x, y) in enumerate(batches):
        skip_sync = config.parallel == "ddp" and i < k - 1
        with net.no_sync() if skip_sync else contextlib.nullcontext():   # through backward
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                logits = net(x)                                       # (B, T, vocab)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / k
            loss.backward()
        total += float(loss.detach())                                 # host-device sync
    finish()
    optimizer.step()
    return total


def train(config: TrainConfig) -> dict:
    """Train on this rank of the initialized process group; return its measurements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    seconds, losses = [], []
    with track(device) as tracker:
        net, optimizer, finish, comm = _setup(config, device)
        for step in range(config.steps):
            batches = _micro_batches(config, step, rank, world, device)
            if comm is not None:
                comm.reset()
            dist.barrier()
            start = now(device)                                       # host-device sync
            losses.append(_step(config, net, optimizer, finish, batches, device))
            seconds.append(now(device) - start)                       # host-device sync
    states = tracker.breakdown("current")
    return {"rank": rank, "world_size": world, "peak": tracker.peak,
            "model_states": states["parameters"] + states["gradients"] + states["optimizer_state"],
            "step_seconds": statistics.median(seconds[1:] or seconds), "losses": losses,
            "sent_bytes": comm.traffic.sent_bytes if comm is not None else None}


def worker(rank: int, world_size: int, config: TrainConfig) -> dict:
    """`train` as a worker for `companion.launch.run` (tests and notebooks)."""
    return train(config)


def parse(argv: list[str] | None = None) -> TrainConfig:
    """A TrainConfig from command-line options (one per field)."""
    parser = argparse.ArgumentParser(prog="python -m companion train",
                                     description=__doc__.split("\n\n")[0])
    defaults = TrainConfig()
    parser.add_argument("--parallel", choices=PARALLEL, default=defaults.parallel,
                        help="none, ddp (chapter 06), zero1, zero2, zero3 (chapter 07)")
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--checkpointing", action="store_true", help="recompute every block")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    for name in ("steps", "batch", "seq_len", "width", "depth", "heads", "vocab", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**{f.name: getattr(args, f.name)
                              for f in dataclasses.fields(TrainConfig)})
    except ValueError as e:
        parser.error(str(e))


def backend_for(local_rank: int, local_world_size: int, gpus: int) -> tuple[str, int | None]:
    """("nccl", this rank's GPU) when every rank on this node has a GPU of its own, ("gloo",
    None) on a machine without GPUs; NCCL cannot put two ranks on one GPU, so more ranks than
    GPUs is refused with what to do instead."""
    if gpus == 0:
        return "gloo", None
    if local_world_size > gpus:
        raise SystemExit(f"torchrun started {local_world_size} ranks on this node, which has "
                         f"{gpus} GPU(s): NCCL needs one GPU per rank. Start at most {gpus} "
                         f"(--nproc_per_node={gpus}), or train on the CPU with gloo: "
                         "CUDA_VISIBLE_DEVICES= torchrun ...")
    return "nccl", local_rank


def main(argv: list[str] | None = None) -> int:
    """Join the process group (torchrun's env://, or alone), train, print rank 0's table."""
    config = parse(argv)
    under_torchrun = "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend, gpu = backend_for(int(os.environ.get("LOCAL_RANK", 0)),
                               int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gpus)
    if gpu is not None:
        torch.cuda.set_device(gpu)
    if under_torchrun:
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(minutes=5))
    else:                                       # one process: a group of one, no network
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        report = train(config)
        reports = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(report, reports, dst=0)                     # collective
        if dist.get_rank() == 0:
            print(report_table(config, reports), flush=True)
        gc.collect()                            # the model's hooks and work handles, freed
                                                # while the group still lives
        dist.barrier()                          # collective: no rank tears down gloo's pairs
    finally:                                    # while another still uses them
        dist.destroy_process_group()
    return 0


def report_table(config: TrainConfig, reports: list[dict]) -> str:
    """Rank 0's printout: the run's techniques, then one line per rank."""
    techniques = [config.parallel, f"accumulation {config.accumulation}", config.precision] + \
        (["checkpointing"] if config.checkpointing else [])
    lines = [f"GPT {config.depth} x {config.width}, {len(reports)} rank(s), "
             f"{', '.join(techniques)}, {config.steps} steps of {config.batch} sequences per rank"]
    for r in reports:
        sent = "" if r["sent_bytes"] is None else f" | sent {format_bytes(r['sent_bytes'])}/step"
        lines.append(f"rank {r['rank']}: peak {format_bytes(r['peak'])} | model states "
                     f"{format_bytes(r['model_states'])} | step {1e3 * r['step_seconds']:.1f} ms"
                     f"{sent} | loss on its slice {r['losses'][0]:.3f} -> "
                     f"{r['losses'][-1]:.3f}")
    return "\n".join(lines)
