"""Chapter 04, exercise 3: a selective checkpointing policy: which operators' outputs to keep."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from companion import checkpointing, models
from companion.checks.core import CheckFailed, call, compare, exercise, fresh_seeds, require
from companion.memory import format_bytes, track

__all__ = ["check_selective_policy"]


class _Operators(TorchDispatchMode):
    """Records, in order, every operator that computes a new tensor (views and in-place ops are
    left out: keeping their output keeps nothing new)."""

    def __init__(self):
        super().__init__()
        self.ops: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        if returns and not all(r.alias_info is not None for r in returns):
            self.ops.setdefault(func, None)
        return func(*args, **(kwargs or {}))


aten = torch.ops.aten
# The operators that compute outside the attention core: a product with a weight matrix, a
# normalisation, an element-wise activation, a residual sum. A failure names none of them, nor
# their kind (one per failure, the hints spelled out the answer): finding them is the exercise.
_OUTSIDE = (aten.addmm, aten.mm, aten.native_layer_norm, aten.gelu, aten.add)
_CRITERION = ("Korthikanti et al. weigh what an output costs to recompute against the bytes it "
              "frees: the attention core's (T, T) tensors are large and cheap to redo, so they "
              "recompute the core and keep every output outside it.")


def _outside_failure(block, xs, table, where: str = "") -> CheckFailed | None:
    """A failure when the policy recomputes anything outside the core, with what recomputing all
    of that beside the core costs in matmul FLOPs and frees in bytes, against the core alone."""
    core = checkpointing.attention_core_policy
    redone = {op for op, keep in table.items() if not keep and op.overloadpacket in _OUTSIDE}
    if not redone:
        return None
    redo = lambda op: core(op) and op not in redone
    plain, mine, ref = (_recompute_flops(block, xs[0], p) for p in (False, redo, core))
    freed = [_kept_bytes(block, x, core) - _kept_bytes(block, x, redo) for x in xs]
    by_core = [_kept_bytes(block, x, False) - _kept_bytes(block, x, core) for x in xs]
    T = xs[0].shape[1]
    flops = (f"; the step's matmul FLOPs go from {ref / plain:.3f}x plain autograd's to "
             f"{mine / plain:.3f}x" if mine != ref else "")
    return CheckFailed(f"your policy recomputes outputs outside the attention core{where}: "
                       f"beside the core's, they free {freed[0]:,} bytes at T = {T} and "
                       f"{freed[1]:,} at T = {2 * T}; the core alone frees {by_core[0]:,} "
                       f"and {by_core[1]:,}{flops}",
                       hint="what an output outside the core frees grows only like T. "
                       + _CRITERION + " List the operators your policy recomputes, in the "
                       "order the block runs them, and ask of each whether it is part of the "
                       "core.")


def _block_gradients(block, x, policy):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = block(x) if policy is False else checkpointing.checkpoint_hooks(block, x, policy=policy)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    return tuple(p.grad.clone() for p in block.parameters()) + (x.grad,)


def _kept_bytes(block, x, policy) -> int:
    """Bytes a checkpointed (or plain, policy False) block keeps between forward and backward."""
    with track(x.device) as tracker:
        y = block(x) if policy is False else checkpointing.checkpoint_hooks(block, x, policy=policy)
        kept = tracker.current - y.untyped_storage().nbytes()
    return kept


def _recompute_flops(block, x, policy) -> int:
    """FLOPs of forward and backward through the checkpointed (or plain, policy False) block,
    counted by PyTorch."""
    x = x.detach().clone().requires_grad_()
    with FlopCounterMode(display=False) as flops:
        y = block(x) if policy is False else checkpointing.checkpoint_hooks(block, x, policy=policy)
        y.sum().backward()
    return flops.get_total_flops()


def _policy_table(answer, block, x) -> dict:
    """policy(op) for every operator the block runs, asked outside autograd's hooks."""
    with _Operators() as seen:
        block(x)
    table = {}
    for op in seen.ops:
        keep = call(answer, op)
        require(isinstance(keep, bool), f"policy({op}) returned {keep!r}, not True or False",
                hint="return a bool: True keeps the operator's output, False recomputes it.")
        table[op] = keep
    return table


@exercise(points=2, timeout=60.0, reference=("companion.checkpointing.attention_core_policy",
                                             "companion.checkpointing.selective.attention_core_policy"))
def check_selective_policy(answer) -> str:
    """answer(op) -> bool: True to keep the output of the aten operator `op` in forward, False to
    recompute it in backward, so that a block recomputes what Korthikanti et al. recompute."""
    # the second block has no biases (as Llama's): its Linear layers run aten.mm, not addmm
    for seed, (width, heads, T, bias) in zip(fresh_seeds(2), [(20, 4, 11, True),
                                                              (42, 3, 7, False)]):
        torch.manual_seed(seed)
        block = models.Block(width, heads, bias=bias)
        xs = [torch.randn(2, t, width, generator=torch.Generator().manual_seed(seed),
                          requires_grad=True) for t in (T, 2 * T)]
        # 1. Every operator the block runs, at both lengths (views included: they are asked too).
        table = _policy_table(answer, block, xs[0]) | _policy_table(answer, block, xs[1])
        require(not all(table.values()), "your policy keeps every operator's output",
                hint="keeping everything saves nothing: it is plain autograd with extra steps.")
        failure = _outside_failure(block, xs, table,
                                   "" if bias else " of a block without biases")
        if failure is not None:
            raise failure
        policy = lambda op: table.get(op, False)
        # 2. Same gradients as without checkpointing.
        compare(_block_gradients(block, xs[0], policy), _block_gradients(block, xs[0], False),
                name="(parameter and input gradients)")
        # 3. Nothing that grows with T² kept: twice the sequence, twice the bytes.
        short, long = (_kept_bytes(block, x, policy) for x in xs)
        require(long == 2 * short,
                f"kept {short} bytes at T = {T} and {long} at T = {2 * T}: something kept grows "
                "faster than T", hint="a (T, T) tensor is still kept: the scores, their scaled or "
                "masked versions, the softmax, the mask, or a view of one of them (a kept view "
                "keeps its whole base alive).")
        # 4. No more than the reference keeps.
        want = _kept_bytes(block, xs[0], checkpointing.attention_core_policy)
        compare(short, want, name=f"bytes kept by one block (width {width}, T = {T}"
                                  f"{'' if bias else ', no biases'})",
                hint="you keep more than the core's recomputation needs: the contiguous copies "
                     "of q, k and v that the core's products make duplicate the output it "
                     "already keeps, and cost nothing to redo." if short > want else "")
    x = torch.randn(2, 96, width, requires_grad=True)                     # a longer sequence
    plain, mine = _kept_bytes(block, x, False), _kept_bytes(block, x, policy)
    flops = _recompute_flops(block, x, policy) / _recompute_flops(block, x, False)
    return (f"at T = 96: kept {format_bytes(plain)} -> {format_bytes(mine)}, for {flops:.3f}x "
            "the matmul FLOPs of plain autograd (only the attention core runs twice)")
