"""Hooks that gather a sharded layer's weights for forward and again for backward
(`check_gather_hooks`)."""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

from companion.checks.core import (CheckFailed, call_inplace, compare, exercise, fresh_seeds,
                                   harness, require)
from companion.memory import format_bytes

__all__ = ["check_gather_hooks"]


class _Sharded(nn.Module):
    """A Linear whose weight and bias were taken out (sharded), held under `names` (the weight's,
    the bias's): forward reads plain attributes."""

    def __init__(self, d_in: int, d_out: int, gathered: list, names: tuple = ("weight", "bias")):
        super().__init__()
        for name in names:
            object.__setattr__(self, name, None)
        self.shape, self.gathered, self.names = (d_out, d_in), gathered, names   # gather()'s calls

    def forward(self, x):
        weight, bias = (getattr(self, name, None) for name in self.names)
        if weight is None or bias is None:
            if not self.gathered:
                raise RuntimeError("weight is None when forward ran, and gather was never called")
            raise RuntimeError("weight is None when forward ran: gather in a forward pre-hook "
                               "and free in a forward hook (after), not in a second pre-hook")
        return nn.functional.linear(x, weight, bias)


class _AllGather(torch.autograd.Function):
    """The check's all-gather: a fresh buffer holding the shard's values, in numpy memory (so
    that the check sees when nothing holds it any more); backward hands the gradient on to the
    shard, as FSDP's reduce-scatter does."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, name: str, buffers: list) -> torch.Tensor:
        memory = shard.detach().numpy().copy()
        buffers.append((name, weakref.ref(memory), memory.nbytes, memory.ctypes.data))
        return torch.from_numpy(memory)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


# The names a layer's sharded tensors go by in each case: torch's, then others (an answer must
# hook the names it is given, not torch's)
_GATHER_NAMES = (("weight", "bias"), ("w", "b"))


def _gather_case(seed: int, d_in: int, d_out: int,
                 names: tuple = ("weight", "bias")) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The full weights that gather() hands out (by `names`: the weight's, the bias's), the input
    and the output's gradient."""
    g = torch.Generator().manual_seed(seed)
    full = {names[0]: torch.randn(d_out, d_in, generator=g),
            names[1]: torch.randn(d_out, generator=g)}
    return full, torch.randn(3, d_in, generator=g), torch.randn(3, d_out, generator=g)


def _alive(buffers: list) -> int:
    return sum(nbytes for _, ref, nbytes, _ in buffers if ref() is not None)     # bytes


def _forward_backward(module, x: torch.Tensor, grad_out, shards: dict, buffers: list,
                      key: str) -> dict:
    """`shards`: the weight's and the bias's, in that order."""
    """One forward (with grad) and backward of `module` on x; what it gave and left behind."""
    out = call_inplace(module, x)       # the module with the answer's hooks, on the harness's x
    seen = {key + "output": out.detach() if isinstance(out, torch.Tensor) else out,
            key + "alive after forward": _alive(buffers), key + "backward error": None}
    try:
        out.backward(grad_out)
    except Exception as e:                              # noqa: BLE001 (the learner's hooks)
        seen[key + "backward error"] = f"{type(e).__name__}: {e}"
    seen[key + "grads"] = [None if t.grad is None else t.grad.clone()
                           for t in (x, *shards.values())]
    for t in shards.values():
        t.grad = None
    return seen


@harness
def _observe_gather_hooks(answer, seed: int, d_in: int, d_out: int,
                          names: tuple = ("weight", "bias")) -> dict:
    """Register the answer's hooks on a sharded layer and train it one step twice: with autograd
    as it is (the hooks alone), then under FSDP-like saved-tensor hooks that save a token for a
    view of gathered memory and gather again in backward. What was gathered and when, outputs,
    gradients, the gathered bytes still alive, what autograd saved, what remove() does."""
    full, x, grad_out = _gather_case(seed, d_in, d_out, names)
    shards = {n: v.clone().requires_grad_() for n, v in full.items()}
    calls, buffers, saved = [], [], {}
    module = _Sharded(d_in, d_out, calls, names)

    def gather(name):
        if name not in shards:
            raise KeyError(f"gather({name!r}): this layer's sharded tensors are {list(names)}, "
                           f"the names your function was given")
        calls.append(name)
        return _AllGather.apply(shards[name], name, buffers)

    def pack(t):
        where = t.untyped_storage().data_ptr()
        for name, ref, _, address in buffers:
            if address == where and ref() is not None:
                return ("token", name, t.storage_offset(), t.shape, t.stride())
        saved[where] = t.untyped_storage().nbytes()
        return ("tensor", t.detach())

    def unpack(packed):
        if packed[0] == "tensor":
            return packed[1]
        _, name, offset, shape, stride = packed
        return gather(name).detach().as_strided(shape, stride, offset)    # gathered again

    handles = call_inplace(answer, module, list(names), gather)   # hooks on this module
    seen = {"early": list(calls)}
    seen.update(_forward_backward(module, x.clone().requires_grad_(), grad_out, shards, buffers,
                                  "plain "))
    seen["calls"], seen["kept"] = list(calls), all(hasattr(module, n) for n in names)
    seen["freed"] = seen["kept"] and all(getattr(module, n) is None for n in names)
    seen["alive"] = _alive(buffers)                      # after backward: nothing holds them
    calls.clear()
    x_tokens, seen["tokens error"] = x.clone().requires_grad_(), None
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            seen.update(_forward_backward(module, x_tokens, grad_out, shards, buffers, "tokens "))
    except CheckFailed as failure:
        seen["tokens error"] = failure.summary
    seen["tokens calls"] = list(calls)
    saved.pop(x_tokens.untyped_storage().data_ptr(), None)     # the input: saved, as it must be
    seen["copies"] = sum(saved.values())
    seen["handles"] = type(handles).__name__ if not (
        isinstance(handles, (tuple, list)) and len(handles) == 2 and
        all(hasattr(h, "remove") for h in handles)) else None
    seen["after_remove"] = None
    if seen["handles"] is None:
        for h in handles:
            h.remove()
        calls.clear()
        with contextlib.suppress(RuntimeError, AttributeError), torch.no_grad():
            module(x)                           # without hooks: None, or deleted, weights
        seen["after_remove"] = list(calls)
    return seen


def _reference_step(full: dict, x: torch.Tensor, grad_out: torch.Tensor) -> tuple:
    """Output and gradients (input, weight, bias) of the unsharded layer (`full`: the weight's
    and the bias's, in that order)."""
    x, w, b = (t.clone().requires_grad_() for t in (x, *full.values()))
    out = nn.functional.linear(x, w, b)
    out.backward(grad_out)
    return out.detach(), [x.grad, w.grad, b.grad]


_NO_GRADIENT = ("use the tensor gather returned as it is: autograd carries its gradient back to "
                "the shard. A .detach(), torch.no_grad() or nn.Parameter(...) around it makes a "
                "new leaf, and the shard gets no gradient.")


_NO_REFERENCE = ("keep no other reference to the gathered tensors or to views of them (no list, "
                 "no closure, no .detach() copy): while one lives, so does the full weight's "
                 "memory.")


def _judge_gather_hooks(seen: dict, expected: torch.Tensor, grads: list, weight_bytes: int,
                        names: tuple = ("weight", "bias")) -> None:
    weight, bias = names
    require(not seen["early"], "gather was called before any forward",
            hint="gather inside the pre-forward hook, not when registering it: "
                 "the full weights must not exist between forwards.")
    compare(seen["plain output"], expected, name="the module's output")
    require(sorted(seen["calls"]) == sorted(names),
            f"gather was called {seen['calls']} in one forward and backward",
            hint="gather each name once per forward, in the pre-forward hook.")
    require(seen["kept"], f"after forward the module has no attribute {weight} (or {bias}) any "
            "more",
            hint="set each name back to None in a forward hook (setattr(mod, name, None)); don't "
                 "delete it: the module reads the attribute.")
    require(seen["freed"], "after forward the module still holds the full weights",
            hint="set each name back to None in a forward hook (module.register_forward_hook), "
                 "so the full tensors can be freed.")
    error = seen["plain backward error"]
    require(error is None, f"backward failed after your hooks ran: {error}",
            hint="autograd saved the gathered weight for backward; your forward hook changed it "
                 "in place (set_, zero_, resize_, .data = ...). Free it by dropping your "
                 "reference only: setattr(mod, name, None).")
    names = ("the input's gradient", "the weight shard's gradient", "the bias shard's gradient")
    for got, want, name in zip(seen["plain grads"], grads, names):
        require(got is not None, f"{name} is None after backward", hint=_NO_GRADIENT)
        compare(got, want, name=name, hint=_NO_GRADIENT)
    require(not seen["alive"], f"{format_bytes(seen['alive'])} of gathered weights are still "
            "in memory after forward and backward", hint=_NO_REFERENCE)
    for error in (seen["tokens error"], seen.get("tokens backward error")):
        require(error is None, f"under FSDP's saved-tensor hooks: {error}",
                hint="set the gathered tensors before forward and None after it, nothing else: "
                     "FSDP's hooks do the rest.")
    alive = seen["tokens alive after forward"]
    require(not alive, f"{format_bytes(alive)} of gathered weights are still in memory after "
            "forward, though autograd kept only tokens", hint=_NO_REFERENCE)
    require(not seen["copies"], f"autograd saved {format_bytes(seen['copies'])} beyond the "
            f"input: a copy of the gathered weight ({format_bytes(weight_bytes)}), which stays "
            "in memory until backward", hint="hand the module the tensor gather returned, not a "
            "copy of it (.clone(), * 1.0, torch.tensor(...)): FSDP can only replace what "
            "autograd saves by a token when it is a view of the gathered memory.")
    require(seen["tokens calls"].count(weight) == 2 and seen["tokens calls"].count(bias) == 1,
            f"with FSDP's saved-tensor hooks gather ran {seen['tokens calls']}: expected the "
            f"weight and bias ({weight!r}, {bias!r}) in forward and the weight again in backward",
            hint="gather once per name in the pre-forward hook and keep no reference after it.")
    for got, want, name in zip(seen["tokens grads"], grads, names):
        require(got is not None, f"{name} is None after backward (tokens)", hint=_NO_GRADIENT)
        compare(got, want, name=f"{name} (weights gathered again in backward)",
                hint=_NO_GRADIENT)
    require(seen["handles"] is None, f"expected the two hook handles, got {seen['handles']}",
            hint="return (module.register_forward_pre_hook(...), "
                 "module.register_forward_hook(...)).")
    require(not seen["after_remove"], "gather still runs after removing the handles",
            hint="return the handles that register_forward_pre_hook / register_forward_hook gave.")


@exercise(points=2, reference="companion.zero.register_gather_hooks")
def check_gather_hooks(answer) -> str:
    """answer(module, names, gather) -> (pre_handle, post_handle): before module's forward set each
    name to gather(name), after it set each to None. Checked through forward *and* backward:
    gradients against the unsharded layer's, gathered memory freed once nothing needs it, and,
    under FSDP-like saved-tensor hooks, freed right after forward and gathered again for
    backward. The second layer's tensors are named other than torch's (`_GATHER_NAMES`)."""
    for seed, (d_in, d_out), names in zip(fresh_seeds(2), [(7, 5), (33, 17)], _GATHER_NAMES):
        full, x, grad_out = _gather_case(seed, d_in, d_out, names)   # the verdict's reference
        expected, grads = _reference_step(full, x, grad_out)
        try:
            seen = _observe_gather_hooks(answer, seed, d_in, d_out, names)
        except CheckFailed as failure:
            if "gather was never called" in failure.summary:
                failure.hint = ("register a forward pre-hook (module.register_forward_pre_hook) "
                                "that sets each name to gather(name).")
            elif "when forward ran" in failure.summary:
                failure.hint = ("free with module.register_forward_hook(fn), whose fn(mod, "
                                "inputs, output) runs after forward.")
            elif "the names your function was given" in failure.summary:
                failure.hint = ("a layer's sharded tensors need not be called weight and bias: "
                                "gather and free each of the names you are given.")
            elif "resize" in failure.summary:
                failure.hint = ("gather hands you a new tensor each time, memory you do not "
                                "own: drop your reference (setattr(mod, name, None)). Torch's "
                                "FSDP resizes storage it allocated itself, and refills it "
                                "before backward (companion.zero.gather).")
            raise
        _judge_gather_hooks(seen, expected, grads, full[names[0]].numel() * 4, names)
    return (f"forward and backward match the unsharded 33 x 17 layer. After forward, "
            f"{format_bytes(seen['plain alive after forward'])} of gathered weight stay alive "
            "with the hooks alone (autograd saved the weight), "
            f"{format_bytes(seen['tokens alive after forward'])} under FSDP's saved-tensor "
            "tokens, which gather it again for backward")
