"""Checkpointed layer inputs offloaded to the host, and where the step's peak really is.

Checkpointing every layer still keeps each layer's input on the device, to recompute it from:
L x (B, T, C), 36 GB for Qwen3-8B at 128k tokens (huggingface/transformers#48444).
`checkpoint_offloaded` runs each layer under non-reentrant `torch.utils.checkpoint` inside
saved-tensor hooks (`InputOffload`), which see exactly what a checkpoint saves, its input: down
to the host in forward, back in backward, layer k - 1's fetched while layer k recomputes.
Memory: after forward no input is on the device, in backward two at most. Cost: two copies each,
hidden where shorter than the compute beside them (`transfer_hides`). The *peak* falls only where
the inputs are part of it (`where_is_the_peak`): accelerate measured no change at short
sequences, -25% at a million tokens (huggingface/accelerate#4175).

    >>> moved = InputOffload()
    >>> h = checkpoint_offloaded(model.blocks, x, offload=moved)   # inputs on the host
    >>> head_and_loss(h).backward()                                # fetched back, one ahead

Simplified vs transformers (`torch.autograd.graph.save_on_cpu(pin_memory=True)` around the
checkpoint: copies on the compute stream, each fetched when asked for), a side stream and a
prefetch added: a chain of one-input layers, run backward last to first; no host-memory limit.
"""
from __future__ import annotations

import contextlib
import dataclasses
from functools import partial
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.flop_counter import FlopCounterMode

from companion.activation_offload import to_device, to_host
from companion.memory import track

if TYPE_CHECKING:
    from companion.plan.costmodel import CostModel

__all__ = ["InputOffload", "checkpoint_offloaded", "MODES", "PeakRow", "where_is_the_peak",
           "Overlap", "transfer_hides"]

MODES = ("plain", "checkpoint", "offload")


class InputOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks that keep each tensor saved inside them on the host, numbered in the
    order saved, and fetch tensor i - 1 back as soon as backward asks for tensor i. One per forward.

    On CUDA the copies run on a side stream, `non_blocking`, from and into pinned memory: down
    beside the layer's forward, the next input up beside this layer's recompute; the compute
    stream waits for it (an event, no host sync) only when it needs it. On a CPU the copies are
    plain, done on return; `track` counts the host copies as host bytes (`placement.on_host`),
    what comes back as device bytes. Counters: `bytes_to_host`, `bytes_to_device`, `prefetched`.
    `prefetch=False` is the naive version (save_on_cpu's): each input fetched when asked for.
    """

    def __init__(self, *, prefetch: bool = True, pin_memory: bool | None = None):
        self.prefetch, self.pin_memory, self.stream = prefetch, pin_memory, None
        self.host: list[tuple[torch.device, torch.Tensor]] = []    # kept for retain_graph
        self.fetched: dict[int, tuple[torch.Tensor, object]] = {}  # i -> (device copy, event)
        self.bytes_to_host = self.bytes_to_device = self.prefetched = 0
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> int:
        if t.is_cuda:                                      # the side stream waits for t, and
            self.stream = self.stream or torch.cuda.Stream(t.device)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            t.record_stream(self.stream)                   # t's block for the copy to finish
        with _on(self.stream):                             # 1. down: device -> host
            self.host.append((t.device, to_host(t, pin_memory=self.pin_memory)))
        self.bytes_to_host += _nbytes(t)
        return len(self.host) - 1                          # the device copy is not kept

    def _fetch(self, i: int) -> None:
        device, host = self.host[i]
        with _on(self.stream):                             # host -> device (CUDA: queued)
            self.fetched[i] = (to_device(host, device),
                              None if self.stream is None else self.stream.record_event())
        self.bytes_to_device += _nbytes(host)

    def _unpack(self, i: int) -> torch.Tensor:
        if i not in self.fetched:
            self._fetch(i)                                 # not fetched ahead: fetch now
        copy, ready = self.fetched.pop(i)
        if ready is not None:
            compute = torch.cuda.current_stream(copy.device)
            compute.wait_event(ready)                      # compute waits, the host does not
            copy.record_stream(compute)
        if self.prefetch and i > 0 and i - 1 not in self.fetched:
            self._fetch(i - 1)                             # 2. the next layer's input, now:
            self.prefetched += 1                           #    beside this layer's recompute
        return copy

    def __enter__(self) -> "InputOffload":
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)                 # the graph holds the hooks from here on: drop
        self.pack_hook = self.unpack_hook = None   # self's own (bound to self, a cycle that kept
                                               # every step's host copies until gc ran)


def _on(stream) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def checkpoint_offloaded(layers: Sequence[Callable], x: torch.Tensor, *,
                         offload: bool | InputOffload = True) -> torch.Tensor:
    """Run `layers` in order on `x`, each under non-reentrant `torch.utils.checkpoint`, its input
    on the host between forward and backward (`InputOffload`; pass one to read its counters).
    `offload=False`: checkpointing alone. Outputs and gradients: those of the plain layers."""
    layers = _checked(layers, x)
    if not isinstance(offload, (bool, InputOffload)):
        raise TypeError(f"offload is True, False or an InputOffload, got {offload!r}")
    hooks = InputOffload() if offload is True else offload or contextlib.nullcontext()
    with hooks:
        for layer in layers:
            x = torch_checkpoint(layer, x, use_reentrant=False)   # saves only x: to the hooks
    return x


def _checked(layers: Sequence[Callable], x: torch.Tensor) -> list[Callable]:
    layers = list(layers)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor (the first layer's input), got "
                        f"{type(x).__name__}")
    if not layers or not all(callable(layer) for layer in layers):
        raise ValueError("layers must be a non-empty sequence of callables (modules), e.g. "
                         "list(model.blocks)")
    return layers


@dataclasses.dataclass(frozen=True)
class PeakRow:
    """One way to run the step: device bytes above its start (host bytes apart), measured and
    predicted; where the prediction puts the peak ("the head", or "layer k": its backward,
    recompute included), with `inputs_at_peak` layer inputs on the device there."""

    mode: str
    after_forward: int
    host_after_forward: int
    peak: int
    predicted_after_forward: int
    predicted_peak: int
    where: str
    inputs_at_peak: int


class _Part(NamedTuple):
    input: int                   # bytes: its input, I
    saved: int                   # what it saves for backward, S (its input among them)
    grads: int                   # its parameters' gradients, G
    peaks: tuple[int, int]       # its backward's peak, alone: plain, checkpointed


def where_is_the_peak(layers: Sequence[Callable], x: torch.Tensor,
                      loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, PeakRow]:
    """Bytes after forward and the step's peak of `loss_fn(layers(x))` in each of `MODES`, measured
    with `track` (gradients made as backward reaches them, as after `zero_grad()`; `.grad` put
    back after) and predicted from the parts. `loss_fn`, the head: a module if it has parameters.

    Parts: per layer its input I, what it saves S (no parameter or buffer), its gradients G; the
    head's saved R (loss included); the backward peak of each layer alone, and of the head. After
    forward: plain ΣS + R, checkpointing ΣI + R, offload R. In layer k's backward, beside its own
    peak: its input, the layers before it (plain: their S; checkpointing: their I; offload: one I,
    fetched ahead), the gradients of those after it. So checkpointing holds all L inputs in its
    last layer, one in its first (backward's end), as offload does. Where a layer's gradients
    outweigh its input (a GPT block: fewer than 12C + 13 tokens) the end is the peak and offload
    leaves it as it was; with more tokens the inputs dominate and it falls, by up to (L - 2)·I.

        >>> where_is_the_peak(list(model.blocks), x, head_and_loss)["offload"].where
    """
    layers = _checked(layers, x)
    modules = [m for m in (*layers, loss_fn) if isinstance(m, torch.nn.Module)]
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    grads = [p.grad for p in params]
    try:
        parts, h = [], x.detach()
        for layer in layers:                                 # 1. each layer alone
            saved, out = _saved(layer, h)
            ones, ckpt = torch.ones_like(out), partial(torch_checkpoint, layer, use_reentrant=False)
            peaks = tuple(_alone(f, h, ones, params)[1] for f in (layer, ckpt))
            grads_k = sum(_nbytes(p) for p in getattr(layer, "parameters", list)()
                          if p.requires_grad)
            parts.append(_Part(_nbytes(h), saved, grads_k, peaks))
            h = out.detach()
        saved, loss = _saved(loss_fn, h)                     # 2. the head alone
        peak, _, left = _alone(loss_fn, h, None, params)
        head = (saved + _nbytes(loss), _nbytes(h) + peak, left - _nbytes(h))  # R, peak, grads
        return {mode: PeakRow(mode, *_alone(partial(_run, layers, loss_fn, mode), x, None,
                                            params, step=True), *_predict(parts, head, mode))
                for mode in MODES}
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def _predict(parts: list[_Part], head: tuple[int, int, int], mode: str
             ) -> tuple[int, int, str, int]:
    """(after forward, peak, where, inputs there) of `mode`, from the parts: 3. the sum."""
    held = [{"plain": p.saved, "checkpoint": p.input, "offload": 0}[mode] for p in parts]
    saved, head_peak, head_grads = head
    at = {"the head": (sum(held) + head_peak, len(parts) if mode != "offload" else 0)}
    for k, part in enumerate(parts):
        ahead = parts[k - 1].input if mode == "offload" and k else 0      # fetched ahead
        later = sum(p.grads for p in parts[k + 1:]) + head_grads
        inputs = 1 + (k > 0) if mode == "offload" else k + 1
        at[f"layer {k}"] = (sum(held[:k]) + ahead + part.input + later
                            + part.peaks[mode != "plain"], inputs)
    where = max(at, key=lambda name: at[name][0])
    return sum(held) + saved, at[where][0], where, at[where][1]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _saved(fn: Callable, h: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the storages `fn(h)` saves for backward but for parameters and `fn`'s buffers
    (they exist before the step), and its output."""
    kept, own = {}, {b.untyped_storage().data_ptr() for b in getattr(fn, "buffers", list)()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t if t._base is None else t._base, torch.nn.Parameter):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(h.detach().requires_grad_())
    return sum(n for ptr, n in kept.items() if ptr not in own), out


def _run(layers: list, loss_fn: Callable, mode: str, leaf: torch.Tensor) -> torch.Tensor:
    h = leaf.clone()                                         # the first input: counted
    if mode == "plain":
        for layer in layers:
            h = layer(h)
    else:
        h = checkpoint_offloaded(layers, h, offload=mode == "offload")
    return loss_fn(h)


def _alone(fn: Callable, h: torch.Tensor, g: torch.Tensor | None, params: list, *,
           step: bool = False) -> tuple[int, ...]:
    """Measured from h (made before: not counted): (peak, peak in backward, bytes left) of
    `fn(h)` times `g`, summed (its output then freed, as in a chain), or of `fn(h)`, the loss;
    `step`: (after forward, host after forward, peak). Gradients made inside, cleared after."""
    for p in params:
        p.grad = None
    h = h.detach().requires_grad_()
    with track(h.device) as t:
        loss = fn(h) if g is None else fn(h).mul(g).sum()
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
            raise ValueError("loss_fn must return the loss: a one-element tensor with a graph")
        after, host = t.current, t.host_current
        loss.backward()
        del loss                                             # bytes left: not the loss
    for p in params:
        p.grad = None
    if step:
        return after, host, t.peak
    line = t.timeline()
    return t.peak, max(n for n, p in zip(line["total"], line["phase"]) if p == "backward"), \
        t.current


@dataclasses.dataclass(frozen=True)
class Overlap:
    """A checkpoint input's copy (one way) against what it hides behind: down, the layer's
    forward; the next input up, this layer's recompute and backward. `hides`: both longer."""

    nbytes: int
    copy_seconds: float
    forward_seconds: float
    backward_seconds: float

    @property
    def hides(self) -> bool:
        return self.copy_seconds <= min(self.forward_seconds, self.backward_seconds)


def transfer_hides(layer: Callable, x: torch.Tensor, *, cost: CostModel | None = None) -> Overlap:
    """`layer`'s input `x` on the host link against the layer's compute, priced by `cost`
    (default `CostModel.for_device` of x's device): the copy at the rate saved tensors move
    (`activation_bandwidth`, else `host_bandwidth`); the forward as its FLOPs (torch's flop
    counter: matmuls and attention) at `flops` (16-bit: x `half_speedup`) plus a third of
    `layer_seconds`; recompute and backward as three forwards (a backward costs about two). A CPU
    overlaps nothing (its copies are done on return): this is what a device at these speeds hides.

        >>> transfer_hides(model.blocks[0], x, cost=CostModel.for_gpu("H100 SXM")).hides
    """
    from companion.plan.costmodel import CostModel     # companion.plan imports this package

    cost = cost if cost is not None else CostModel.for_device(x.device.type)
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a companion.plan.CostModel, got {type(cost).__name__}")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        layer(x)
    rate = cost.flops * (cost.half_speedup if x.element_size() == 2 else 1.0)
    forward = counter.get_total_flops() / rate + cost.layer_seconds / 3
    link = cost.activation_bandwidth or cost.host_bandwidth
    return Overlap(_nbytes(x), _nbytes(x) / link, forward, 3 * forward)
