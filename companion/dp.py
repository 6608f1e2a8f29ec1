"""DataParallel as torch.nn.DataParallel runs it: one process, one master device, N replicas.

One training step, in the order the data moves:

1. replicate   the master's parameters are copied to every device;
2. scatter     the batch is split in N slices, one per device;
3. forward     each replica runs on its slice (torch uses N Python threads, sharing one GIL);
4. gather      every output is copied back to the master;
5. loss        computed on the master, over the whole batch;
6. backward    the loss gradient is scattered back and each replica runs its backward;
7. reduce      every replica's gradients are summed on the master;
8. step        the optimizer updates the master's parameters;
9. broadcast   the next step copies them out again (step 1).

The master holds the whole batch, every output, the loss's saved tensors for the whole batch and
the reduced gradients on top of its own replica's share, and all traffic goes through its link:
that is the bottleneck DDP removes. Here the replicas live on `devices` (default: N copies on the
CPU standing in for N devices) and run one after another, so the time measured is the serial time,
phase by phase. The bytes each phase allocates on the master are measured with
`companion.memory.track` (gather, loss and reduce run on the master only, so on a CPU the count is
the master's alone).

Example:
    >>> dp = DataParallel(model, n_replicas=4)
    >>> loss = dp.train_step(x, y, nn.functional.mse_loss, optimizer)   # optimizer on model
    >>> dp.last_report.seconds, dp.last_report.master_bytes

Simplified vs PyTorch: torch's replicas keep autograd links to the master parameters (Broadcast's
backward is the reduce), runs replicas in threads, and scatters keyword arguments too.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Sequence

import torch
from torch import nn

from companion.memory import track
from companion.cost.clock import now

__all__ = ["DataParallel", "StepReport", "PHASES"]

PHASES = ("replicate", "scatter", "forward", "gather", "loss", "backward", "reduce", "step")


@dataclasses.dataclass
class StepReport:
    """Seconds per phase, and bytes measured per device: each replica's share after its forward
    (weights, its slice, its saved activations; not its gradients), and what the master-only
    phases allocate on the master, phase by phase (separate peaks, not one peak of the step)."""

    seconds: dict[str, float]
    replica_bytes: list[int]          # per device: parameters + its input slice + saved activations
    master_bytes: dict[str, int]      # on the master: the batch, and the most gather, gather +
                                      # loss, and reduce had allocated at once (measured)

    @property
    def master_extra_bytes(self) -> int:
        """What the master holds beyond a replica: the whole batch plus the largest of the
        master-only phases (gathered outputs, gathered + loss, reduced gradients). A sum of
        measured parts, an estimate of the master's busiest moment, not one measured peak."""
        return self.master_bytes["batch"] + max(v for k, v in self.master_bytes.items()
                                                if k != "batch")


class DataParallel:
    """Data parallelism in one process, with the master device doing the extra work."""

    def __init__(self, module: nn.Module, *, n_replicas: int = 2,
                 devices: Sequence[torch.device | str] | None = None):
        self.module = module
        self.devices = [torch.device(d) for d in devices] if devices else \
            [next(module.parameters()).device] * n_replicas
        self.last_report: StepReport | None = None

    def train_step(self, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                   optimizer: torch.optim.Optimizer) -> float:
        """One step of steps 1-8 above; the master is `self.module` on `self.devices[0]`."""
        seconds = dict.fromkeys(PHASES, 0.0)
        clock, master = _Clock(seconds), self.devices[0]
        on_master = {"batch": _nbytes(x) + _nbytes(y)}
        with clock("replicate"):
            replicas = [copy.deepcopy(self.module).to(d) for d in self.devices]        # 1.
        with clock("scatter"):
            slices = [s.to(d) for s, d in zip(x.chunk(len(self.devices)), self.devices)]  # 2.
        saved = [0] * len(replicas)
        outputs = []
        for i, (replica, part) in enumerate(zip(replicas, slices)):
            with clock("forward"), _count_saved(saved, i, replica):
                outputs.append(replica(part))                                          # 3.
        with clock("gather"), track(master) as gather:
            gathered = torch.cat([o.to(master) for o in outputs])    # (B, ...) on the master 4.
        with clock("loss"), track(master) as in_loss:
            loss = loss_fn(gathered, y.to(master))                                     # 5.
        with clock("backward"):
            loss.backward()                                                            # 6.
        with clock("reduce"), track(master) as reduce:
            for name, param in self.module.named_parameters():                         # 7.
                total = torch.zeros_like(param)
                for r in replicas:
                    total += r.get_parameter(name).grad.to(master)  # one replica's at a time
                param.grad = total
        with clock("step"):
            optimizer.step()                                                           # 8.
            optimizer.zero_grad(set_to_none=False)
        on_master.update(gather=gather.peak, loss=gather.current + in_loss.peak,
                         reduce=reduce.peak)
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        self.last_report = StepReport(
            seconds=seconds, master_bytes=on_master,
            replica_bytes=[params + _nbytes(s) + a for s, a in zip(slices, saved)])
        return float(loss.detach())


class _Clock:
    """`with clock("phase"):` adds the block's wall time to seconds["phase"]."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds, self.phase, self.start = seconds, "", 0.0

    def __call__(self, phase: str) -> "_Clock":
        self.phase = phase
        return self

    def __enter__(self) -> None:
        self.start = now(None)                     # every GPU's queued work done (a sync)

    def __exit__(self, *exc) -> None:
        self.seconds[self.phase] += now(None) - self.start   # host-device sync, every GPU


class _count_saved(torch.autograd.graph.saved_tensors_hooks):
    """Add the bytes of every activation autograd saves for backward (not weights) to totals[i]."""

    def __init__(self, totals: list[int], i: int, replica: nn.Module):
        weights = {p.untyped_storage().data_ptr() for p in replica.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in weights:
                totals[i] += _nbytes(t)
            return t
        super().__init__(pack, lambda t: t)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
