"""The second design: saved-tensor hooks ("non-reentrant"), and selective recomputation.

The block runs forward *normally*, building an ordinary autograd graph, but under
`torch.autograd.graph.saved_tensors_hooks` whose pack keeps nothing but a number. When backward
first asks for one of those numbers (unpack), the block runs again once, this time with a pack that
keeps every tensor, in the same order; unpack then hands back tensor number i. No backward runs
inside backward: the graph is the one built in forward, so `torch.autograd.grad`, keyword
arguments and outputs that are not tensors all work, which the reentrant design cannot offer.
PyTorch's own `torch.utils.checkpoint` has recommended this design (use_reentrant=False) since 2.1.

Selective recomputation (PyTorch's selective activation checkpointing) keeps the outputs of some
operators and recomputes the rest: a `policy(op) -> bool` says which to keep. `save_linear_outputs`
keeps only the Linear layers' matrix multiplies and recomputes everything else; Korthikanti et al.
(2022, arXiv:2205.05198) recompute far less, only the attention core
(`companion.checkpointing.selective`).

Memory: the block's inputs, plus whatever the policy keeps; during backward, one block's saved
tensors at a time. Cost: one more forward of the block (minus the operators the policy keeps).

Example:
    >>> y = checkpoint_hooks(block, x)                        # full recomputation
    >>> y = checkpoint_hooks(block, x, policy=save_linear_outputs)
    >>> torch.autograd.grad(y.sum(), x)                       # works, unlike the reentrant one

A kept output that is changed in place after forward made it raises in backward, as PyTorch's
selective checkpointing does (with its message): recomputing from the changed value would give
wrong gradients.

Simplified vs PyTorch: recomputation always runs the whole block (PyTorch stops as soon as it has
the tensors it needs), no check that the recomputed tensors match the originals' shapes, and the
policy sees only the operator (PyTorch's also sees its arguments and can tell PREFER from MUST);
no `allow_cache_entry_mutation`, no `determinism_check` or `debug` options, no early stop.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["checkpoint_hooks", "save_linear_outputs", "save_matmul_outputs"]

aten = torch.ops.aten
Policy = Callable[[torch._ops.OpOverload], bool]


def save_linear_outputs(op: torch._ops.OpOverload) -> bool:
    """Keep what nn.Linear computes (aten.mm, aten.addmm); recompute the rest: attention's
    (T, T) products and softmax, and also LayerNorm and GELU. (Megatron's selective
    recomputation, Korthikanti et al. 2022, is narrower: it recomputes only the attention core,
    q·kᵀ, softmax, dropout and weights·v, and keeps everything else.)"""
    return op.overloadpacket in (aten.mm, aten.addmm)


def save_matmul_outputs(op: torch._ops.OpOverload) -> bool:
    """Keep every matrix multiply (the batched ones of attention too); recompute the rest."""
    return op.overloadpacket in (aten.mm, aten.addmm, aten.bmm, aten.baddbmm)


def _detached(out: Any) -> Any:
    """`out`'s tensors detached, sharing storage and version counter with them. Below autograd
    (inside a dispatch mode) detach shares the counter only with the ADInplaceOrView key on."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _versions(out: Any) -> list[int]:
    """The version counters of the tensors in `out`: each in-place op on a tensor (or on a view
    or detached alias of it, which share its counter) adds one."""
    return [t._version for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class _KeepOutputs(TorchDispatchMode):
    """First run: store the outputs of the operators `policy` keeps. Recompute: hand them back,
    in the same order, instead of running those operators again, each let go as it is handed
    back (so it is freed once backward has used it). A second backward through the same graph
    (retain_graph=True) finds them gone and raises, as PyTorch's selective checkpointing does."""

    def __init__(self, policy: Policy, kept: list, *, replay: bool):
        super().__init__()
        self.policy, self.kept, self.replay = policy, kept, replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.policy(func):
            return func(*args, **(kwargs or {}))
        if self.replay:
            if not self.kept:
                raise RuntimeError("a selectively checkpointed block can be backpropagated "
                                   "through once: its kept outputs were handed to the first "
                                   "backward. Run forward again (or use policy=None, full "
                                   "recomputation, which supports retain_graph=True).")
            out, versions = self.kept.pop(0)
            if _versions(out) != versions:         # changed in place since it was kept
                raise RuntimeError(
                    f"Tensor cached during selective activation checkpoint has been mutated: "
                    f"the output of {func} that the policy keeps was changed in place after "
                    "forward made it (e.g. `h = linear(x); h += x`), so recomputing from it would "
                    "give wrong gradients. Make that operation out of place (`h = h + x`), or "
                    "leave the operator out of the policy.")
            return out
        out = func(*args, **(kwargs or {}))
        kept = _detached(out)                      # same storage: kept alive, not copied
        self.kept.append((kept, _versions(kept)))
        return out


class _Frame:
    """One checkpointed call: how to run it again, and the tensors of its last recomputation."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, policy: Policy | None):
        self.fn, self.args, self.kwargs, self.policy = fn, args, kwargs, policy
        self.packed, self.recomputed, self.kept = 0, {}, []
        self.cpu_rng = torch.get_rng_state()
        self.cuda_devices = sorted({a.device.index for a in args
                                    if isinstance(a, torch.Tensor) and a.is_cuda})
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in self.cuda_devices]
        self.autocast = autocast_settings()

    def run(self, *, replay: bool):
        if self.policy is None:
            return self.fn(*self.args, **self.kwargs)
        with _KeepOutputs(self.policy, self.kept, replay=replay):
            return self.fn(*self.args, **self.kwargs)

    def pack(self, t: torch.Tensor) -> int:
        self.packed += 1
        return self.packed - 1                      # a number: the tensor itself is not kept

    def unpack(self, i: int) -> torch.Tensor:
        if i not in self.recomputed:                # first unpack, and again in a second
            self.recompute()                        # backward after retain_graph=True (policy
        return self.recomputed.pop(i)               # None only); freed once backward used it

    def recompute(self) -> None:
        found: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> int:
            found.append(t)
            return len(found) - 1

        # 1. Same random state (same dropout masks), same autocast, grad on.
        with torch.random.fork_rng(devices=self.cuda_devices):
            torch.set_rng_state(self.cpu_rng)
            for device, state in zip(self.cuda_devices, self.cuda_rng):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad(), _autocast(self.autocast), \
                    torch.autograd.graph.saved_tensors_hooks(keep, found.__getitem__):
                self.run(replay=True)               # 2. pack number i is saved tensor i again
        self.recomputed = dict(enumerate(found))
        found.clear()                               # 3. only `recomputed` holds them now


def autocast_settings() -> list[tuple[str, bool, torch.dtype]]:
    """Whether autocast is on, and in which dtype, for each device type: what a recomputation
    must enter again to compute what forward computed."""
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")]


class _autocast:
    """Enter the autocast settings recorded in forward, for every device type."""

    def __init__(self, settings):
        self.contexts = [torch.autocast(d, dtype=dtype, enabled=on) for d, on, dtype in settings]

    def __enter__(self):
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def checkpoint_hooks(fn: Callable, *args, policy: Policy | None = None, **kwargs):
    """`fn(*args, **kwargs)` with its saved tensors dropped in forward and recomputed in backward.

    `policy(op) -> bool` keeps the outputs of the operators it returns True for (selective
    recomputation); None recomputes everything. Gradients are the same, bit for bit, as without
    checkpointing and as `torch.utils.checkpoint(fn, *args, use_reentrant=False)`.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)                  # nothing would be saved anyway
    frame = _Frame(fn, args, kwargs, policy)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return frame.run(replay=False)
