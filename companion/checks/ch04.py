"""Checks for chapter 04, gradient checkpointing."""
from __future__ import annotations

import itertools
import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from companion import checkpointing, models
from companion.checks.core import (CheckFailed, call, call_inplace, compare, exercise,
                                   fresh_seeds, harness, require)
from companion.memory import format_bytes, track

__all__ = ["check_saved_bytes", "check_checkpoint_function", "check_selective_policy",
           "check_checkpoint_plan"]


def _block(seed: int, width: int, p: float) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 3 * width), torch.nn.GELU(),
                               torch.nn.Dropout(p), torch.nn.Linear(3 * width, width), torch.nn.Tanh())


def _square(t: torch.Tensor) -> torch.Tensor:
    return t * t


def _sigmoid_exp_matmul(t: torch.Tensor) -> torch.Tensor:
    return t.sigmoid().exp() @ t.T


def _slices_product(t: torch.Tensor) -> torch.Tensor:
    """Saves two slices of one storage (as attention saves q, k and v cut from one qkv output)."""
    doubled = t * 2                                # column 1 is saved by neither slice
    first, rest = doubled[:, :1], doubled[:, 2:]   # (rows, 1), (rows, width - 2)
    return (first * rest) * rest                   # rest is saved twice


def _flat_second_layer(seed: int, width: int) -> torch.nn.Module:
    """The second Linear of a two-layer model whose four parameters are views of one flat
    buffer, as FSDP and ZeRO flatten a model's parameters: its weight starts inside the buffer,
    not at its first byte."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(width, width), torch.nn.Linear(width, width)]
    flat = torch.cat([p.detach().reshape(-1) for layer in layers for p in layer.parameters()])
    start = 0
    for layer in layers:
        for name in ("weight", "bias"):
            p = getattr(layer, name)
            setattr(layer, name, torch.nn.Parameter(flat[start:start + p.numel()].view_as(p)))
            start += p.numel()
    return layers[1]


def _input(seed: int, width: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed),
                       requires_grad=True)


@harness
def _flat_layer_saved(answer, seed: int, width: int):
    """The answer's bytes for `_flat_second_layer` on the check's input, both made here: a copy
    for the answer (`call`) would give each parameter a storage of its own (a Parameter's
    deepcopy clones its data), and the shared buffer would be gone."""
    return call_inplace(answer, _flat_second_layer(seed, width), _input(seed, width, 7))


def _parameter_pointer_bytes(fn, x) -> int:
    """Known wrong: parameters told apart by p.data_ptr(), where each one starts, not by the
    storage that holds it."""
    params = {p.data_ptr() for p in fn.parameters()} if isinstance(fn, torch.nn.Module) else set()
    storages: dict[int, int] = {}
    for s in checkpointing.saved_for_backward(fn, x):
        if s.storage not in params:
            storages[s.storage] = s.storage_nbytes
    return sum(storages.values())


def _view_bytes(fn, x) -> int:
    """Known wrong: each saved view counted by its own bytes, views told apart by t.data_ptr()."""
    views: dict[int, int] = {}
    for t in _saved_tensors(fn, x):
        views[t.data_ptr()] = t.numel() * t.element_size()
    return sum(views.values())


def _saved_tensors(fn, x) -> list[torch.Tensor]:
    """The non-parameter tensors fn(x) saves for backward."""
    params = {p.data_ptr() for p in fn.parameters()} if isinstance(fn, torch.nn.Module) else set()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x)
    return [t for t in saved if t.untyped_storage().data_ptr() not in params]


def _first_view_bytes(fn, x) -> int:
    """Known wrong: the bytes of the first view seen of each storage, not the storage's size."""
    first: dict[int, int] = {}
    for s in checkpointing.saved_for_backward(fn, x):
        if not s.is_parameter:
            first.setdefault(s.storage, s.nbytes)
    return sum(first.values())


@exercise(points=1, reference=("companion.checkpointing.activation_bytes",
                               "companion.checkpointing.saved_for_backward",
                               "companion.checks.ch04._saved_tensors"))
def check_saved_bytes(answer) -> str:
    """answer(fn, x) -> int: bytes of the tensors `fn(x)` saves for backward that are not
    parameters of `fn`, each storage counted once and whole."""
    for seed, width in zip(fresh_seeds(3), [5, 9, 16]):
        x = _input(seed, width, 7)
        block = _block(seed, width, 0.0)
        flat = _flat_second_layer(seed, width)
        cases = [(block, "an MLP block"), (_square, "x * x"),
                 (_sigmoid_exp_matmul, "sigmoid, exp, matmul"),
                 (_slices_product, "two slices of one tensor, multiplied"),
                 (flat, "the second layer of a model whose parameters share one flat buffer "
                  "(as FSDP flattens them)")]
        for fn, label in cases:
            want = checkpointing.activation_bytes(fn, x)
            saved = checkpointing.saved_for_backward(fn, x)
            with_params = sum({s.storage: s.storage_nbytes for s in saved}.values())
            every_save = sum(s.nbytes for s in saved if not s.is_parameter)
            # the first match is the hint: on the flat buffer, parameters told apart by where
            # they start give what counting the parameters does, and that answer kept them out
            # of the MLP block already
            wrong = {
                "a parameter can be a view into a larger buffer (here one flat buffer holds "
                "both layers' parameters, and this layer's start inside it): where a parameter "
                "starts is not where its storage starts.": _parameter_pointer_bytes(fn, x),
                "a tensor saved twice (x * x saves x twice, and a ReLU's output is saved again by "
                "the next Linear) exists once: count each storage once "
                "(t.untyped_storage().data_ptr()).": every_save,
                "leave out the parameters: the weights are in memory anyway, with or without "
                "backward (compare storages with fn.parameters()).": with_params,
                "a saved view keeps its whole storage alive: count t.untyped_storage().nbytes(), "
                "not the first view's numel() * element_size() (two slices of one tensor hold "
                "all of it).": _first_view_bytes(fn, x),
                "views of one tensor share its storage: tell storages apart by "
                "t.untyped_storage().data_ptr(), not t.data_ptr() (a slice starts elsewhere in "
                "the same storage).": _view_bytes(fn, x),
            }
            got = _flat_layer_saved(answer, seed, width) if fn is flat else call(answer, fn, x)
            compare(got, want, name=f"bytes saved by {label}",
                    hint="pack every tensor with torch.autograd.graph.saved_tensors_hooks and add "
                         "t.untyped_storage().nbytes() for each new storage.", known_wrong=wrong)
    return "you can see what autograd keeps: the inputs of each layer, not the weights"


def _gradients(fn_wrapper, block, x, seed, *, autocast: bool = False):
    """(output, parameter and input gradients) of fn_wrapper(block, x); with `autocast`, forward
    runs under CPU bf16 autocast and backward after its block has closed, as a training step does."""
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = fn_wrapper(block, x)
    if not isinstance(y, torch.Tensor) or not y.requires_grad:
        raise CheckFailed(f"expected a tensor that requires grad, got {type(y).__name__}"
                          + (" without grad" if isinstance(y, torch.Tensor) else ""),
                          hint="return the output of Checkpoint.apply(fn, x).")
    weights = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    (y * weights).sum().backward()
    grads = tuple(p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                  for p in block.parameters())
    return y.detach(), grads + (x.grad if x.grad is not None else torch.zeros_like(x),)


@harness
def _checkpoint_forward(answer, seed: int, width: int, p: float) -> tuple[int, int]:
    """(bytes the answer's forward keeps for backward, how many times it ran fn)."""
    block, calls = _block(seed, width, p), []
    counted = lambda t: (calls.append(1), block(t))[1]
    torch.manual_seed(seed)
    kept = checkpointing.activation_bytes(lambda t: call_inplace(answer, counted, t),
                                          _input(seed, width))
    return kept, len(calls)


@harness
def _checkpoint_backward(answer, seed: int, width: int, p: float) -> tuple[tuple, int]:
    """((output, gradients) through the answer, how many times fn ran in forward and backward)."""
    block, calls = _block(seed, width, p), []
    counted = lambda t: (calls.append(1), block(t))[1]
    got = _gradients(lambda m, t: call_inplace(answer, counted, t), block, _input(seed, width),
                     seed)
    return got, len(calls)


@harness
def _autocast_gradients(answer, seed: int, width: int) -> tuple:
    """(output, gradients) of a block through the answer (plain autograd when answer is None),
    forward under CPU bf16 autocast, backward outside it."""
    run = (lambda m, t: m(t)) if answer is None else (lambda m, t: call_inplace(answer, m, t))
    return _gradients(run, _block(seed, width, 0.0), _input(seed, width), seed, autocast=True)


@harness
def _random_after_backward(answer, seed: int, width: int) -> torch.Tensor:
    """torch.rand after a backward through two stacked checkpointed blocks with dropout (the
    answer's, or plain autograd's when answer is None): a checkpoint must leave the caller's
    random stream where plain autograd leaves it."""
    first, second = _block(seed, width, 0.5), _block(seed + 1, width, 0.5)
    run = (lambda fn, t: fn(t)) if answer is None else \
        (lambda fn, t: call_inplace(answer, fn, t))
    torch.manual_seed(seed)
    y = run(second, run(first, _input(seed, width)))
    if isinstance(y, torch.Tensor) and y.requires_grad:
        y.sum().backward()
    return torch.rand(8)


@exercise(points=3, timeout=20.0, reference=("companion.checkpointing.Checkpoint",
                                             "companion.checkpointing.checkpoint",
                                             "torch.utils.checkpoint.checkpoint",
                                             "companion.checkpointing.checkpoint_hooks",
                                             "torch.utils.checkpoint.CheckpointFunction"))
def check_checkpoint_function(answer) -> str:
    """answer(fn, x) -> fn(x), keeping only x for backward and recomputing fn inside backward.
    x requires grad; fn may use dropout; forward may run under autocast."""
    saved_plain = saved_mine = 0
    seeds = fresh_seeds(3)
    for seed, width, p in zip(seeds, [6, 11, 16], [0.0, 0.5, 0.3]):
        block, x = _block(seed, width, p), _input(seed, width)
        plain_saved = checkpointing.activation_bytes(block, x)
        want = _gradients(lambda m, t: m(t), block, x, seed)
        mine_saved, calls = _checkpoint_forward(answer, seed, width, p)
        require(calls == 1, f"fn ran {calls} times in forward; expected once",
                hint="forward runs fn once, under torch.no_grad().")
        require(mine_saved <= x.numel() * x.element_size(),
                f"forward kept {mine_saved} bytes for backward; a checkpoint keeps only its input "
                f"({x.numel() * x.element_size()} bytes; plain autograd keeps {plain_saved})",
                hint="run fn under torch.no_grad() in forward, so autograd saves nothing inside it; "
                     "ctx.save_for_backward(x) is all you keep.")
        saved_plain, saved_mine = saved_plain + plain_saved, saved_mine + mine_saved
        got, calls = _checkpoint_backward(answer, seed, width, p)
        require(calls == 2, f"fn ran {calls} times in forward and backward; expected "
                            "twice (once more to recompute)",
                hint="in backward, run fn again on a detached copy of x with grad enabled, then "
                     "backpropagate through that.")
        try:
            compare(got, want, name="(output, parameter and input gradients)")
        except CheckFailed as failure:
            if p > 0:
                failure.hint = ("with dropout the recomputation must draw the same masks: save "
                                "torch.get_rng_state() in forward and restore it (inside "
                                "torch.random.fork_rng()) before running fn in backward.")
            else:
                failure.hint = ("return x.grad of the recomputed input from backward, one "
                                "value per forward argument (None for fn).")
            raise
    plain_random = _random_after_backward(None, seeds[0], 7)
    plain_autocast = _autocast_gradients(None, seeds[1], 10)
    compare(_random_after_backward(answer, seeds[0], 7), plain_random,
            name="torch.rand(8) after backward through two stacked checkpoints",
            hint="restore the saved random state inside `with torch.random.fork_rng():`, so the "
                 "recomputation does not rewind the random stream of the code around backward.")
    compare(_autocast_gradients(answer, seeds[1], 10), plain_autocast,
            name="(output, parameter and input gradients) under bf16 autocast",
            hint="forward ran inside an autocast block and backward after it closed, so your "
                 "recomputation ran at another precision than forward did: remember forward's "
                 "autocast settings for the tensors' device (here the CPU, not CUDA) and "
                 "recompute under them.")
    return (f"same gradients as plain autograd (with dropout, and under autocast), random stream "
            f"left as it was; saved for backward "
            f"{format_bytes(saved_plain)} -> {format_bytes(saved_mine)}")


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


def _equal_segments(saved, inputs, cost, budget):
    """Known wrong: checkpoint_sequential's equal layer counts, the fewest that fit."""
    n = len(saved)
    for s in range(1, n + 1):
        starts = [i * (n // s) for i in range(s)]
        if checkpointing.plan_cost(starts, saved, inputs, cost)[0] <= budget:
            return starts
    return None


def _search(saved, inputs, cost, budget, peak, fits=int.__le__):
    """The least-recompute plan under a given (possibly wrong) peak rule and test of "fits"."""
    n, best = len(saved), None
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            starts = [0, *cuts]
            recompute = checkpointing.plan_cost(starts, saved, inputs, cost)[1]
            if fits(peak(starts), budget) and (best is None or recompute < best[0]):
                best = (recompute, starts)
    return None if best is None else best[1]


def _held(starts, saved):
    """The saved bytes of each segment."""
    return [sum(saved[a:b]) for a, b in zip(starts, list(starts[1:]) + [len(saved)])]


def _kept(starts, inputs):
    """Every checkpoint: the inputs of all segments but the last."""
    return sum(inputs[a] for a in starts[:-1])


def _bound(saved, inputs, cost, budget):
    """Known wrong: Chen et al.'s bound, every checkpoint beside the largest segment."""
    return _search(saved, inputs, cost, budget,
                   lambda st: checkpointing.plan_cost(st, saved, inputs, cost, bound=True)[0])


def _no_inputs(saved, inputs, cost, budget):
    """Known wrong: the kept segment inputs left out of the peak."""
    return _search(saved, inputs, cost, budget, lambda st: max(_held(st, saved)))


def _last_only(saved, inputs, cost, budget):
    """Known wrong: only the last segment's saved bytes counted, not the recomputed ones."""
    return _search(saved, inputs, cost, budget,
                   lambda st: _kept(st, inputs) + _held(st, saved)[-1])


def _own_input_dropped(saved, inputs, cost, budget):
    """Known wrong: a recomputed segment's own checkpoint left out beside its saved bytes."""
    def peak(st):
        before = [sum(inputs[a] for a in st[:j]) for j in range(len(st))]
        return max(k + h for k, h in zip(before[:-1] + [_kept(st, inputs)], _held(st, saved)))
    return _search(saved, inputs, cost, budget, peak)


def _later_alive(saved, inputs, cost, budget):
    """Known wrong: backward read first to last, so a recomputed segment sits beside its own
    checkpoint and the later ones, the earlier ones freed."""
    def peak(st):
        kept = [inputs[a] for a in st[:-1]]
        alive = [sum(kept[j:]) for j in range(len(kept))] + [sum(kept)]
        return max(k + h for k, h in zip(alive, _held(st, saved)))
    return _search(saved, inputs, cost, budget, peak)


def _all_inputs(saved, inputs, cost, budget):
    """Known wrong (off by one): the last segment's input counted as a kept checkpoint too."""
    return _search(saved, inputs, cost, budget,
                   lambda st: max(checkpointing.plan_cost(st, saved, inputs, cost)[0],
                                  sum(inputs[a] for a in st) + _held(st, saved)[-1]))


def _strict(saved, inputs, cost, budget):
    """Known wrong: "fits" read as peak < budget."""
    return _search(saved, inputs, cost, budget,
                   lambda st: checkpointing.plan_cost(st, saved, inputs, cost)[0], int.__lt__)


def _fewest_segments(saved, inputs, cost, budget):
    """Known wrong: the fewest segments that fit, whatever they recompute."""
    n = len(saved)
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            if checkpointing.plan_cost([0, *cuts], saved, inputs, cost)[0] <= budget:
                return [0, *cuts]
    return None


def _greedy(saved, inputs, cost, budget):
    """Known wrong: grow a segment until it would not fit beside the checkpoints kept so far."""
    starts, kept, run = [0], 0, 0
    for i, b in enumerate(saved):
        if i and kept + inputs[starts[-1]] + run + b > budget:
            kept, run = kept + inputs[starts[-1]], 0
            starts.append(i)
        run += b
    return starts


_PLAN_HINTS = [
    (_equal_segments, "layers differ: equal numbers of layers are not equal bytes or equal "
                      "recompute; cut where the bytes and the costs say."),
    (_no_inputs, "each checkpointed segment keeps its input (inputs[start]) until its backward: "
                 "add the checkpoints alive at each moment to the peak."),
    (_last_only, "a checkpointed segment's saved tensors all come back while it is recomputed: "
                 "any segment can set the peak, not only the last one."),
    (_bound, "all checkpoints beside the largest segment is Chen et al.'s upper bound, not the "
             "peak: backward runs from the last segment to the first and frees each checkpoint "
             "when its segment is done, so an earlier segment is recomputed without the later "
             "segments' checkpoints."),
    (_own_input_dropped, "a segment's own checkpoint is still alive while it is recomputed (the "
                         "recomputation starts from it): count it beside the segment's saved "
                         "bytes."),
    (_later_alive, "backward runs the segments from the last to the first: while a segment is "
                   "recomputed, the checkpoints of the segments after it are already freed, and "
                   "its own and those before it are still alive."),
    (_all_inputs, "the last segment is not checkpointed: its input is not a kept checkpoint "
                  "(count inputs[start] for every segment but the last)."),
    (_strict, "a plan fits when its peak is at most the budget: look at plans whose peak equals "
              "the budget exactly."),
    (_fewest_segments, "fewer segments is not less recompute: minimise the cost of the layers in "
                       "checkpointed segments."),
    (_greedy, "cutting greedily does not look ahead: a later checkpoint adds its input to the "
              "peak of the segments after it, and a greedy cut can recompute more than needed; "
              "compare whole plans."),
]


def _plan_cases(seed: int) -> list[tuple[list, list, list, int]]:
    """Fixed cases (the first 13), in an order where each wrong rule above first fails with its own
    hint (two of them where Chen et al.'s bound changes the best plan or finds none; the 13th where
    every plan of the fewest segments that fits recomputes more than the best, which has four),
    then random uneven layers and budgets."""
    cases = [([5, 2, 2, 1], [1, 1, 3, 2], [1, 4, 3, 5], 7),
             ([1, 2, 3], [1, 1, 1], [5, 1, 2], 5),
             ([5, 4, 5], [1, 1, 1], [5, 4, 2], 8),
             ([1, 3, 4], [1, 1, 3], [5, 3, 2], 6),
             ([2, 4, 2, 3], [1, 1, 1, 1], [3, 4, 4, 1], 7),
             ([3, 1, 2], [1, 1, 1], [5, 2, 1], 5),
             ([3, 3, 8, 5], [3, 2, 1, 1], [3, 4, 1, 5], 13),            # later checkpoints alive
             ([5, 6, 5, 2, 7], [3, 1, 2, 2, 2], [5, 3, 1, 2, 2], 14),    # the bound: a dearer plan
             ([3, 2, 2], [3, 1, 1], [1, 1, 3], 6),                       # the bound: none fits
             ([11, 1, 4, 3, 10], [1, 3, 1, 1, 2], [2, 4, 3, 4, 4], 15),
             ([3, 3, 3], [1, 1, 1], [1, 1, 1], 2), ([7], [2], [1], 7),
             ([7, 7, 3, 3, 3, 7], [3, 4, 6, 1, 1, 7], [4, 4, 3, 4, 5, 4], 18)]   # fewest: dearer
    rng = random.Random(seed)
    for _ in range(10):
        n = rng.randrange(3, 11)
        saved = [rng.choice([rng.randrange(10, 100), rng.randrange(100, 900)]) for _ in range(n)]
        inputs = [max(1, b // rng.randrange(2, 9)) for b in saved]
        cost = [round(rng.uniform(0.5, 5.0), 2) for _ in range(n)]
        low = min(checkpointing.plan_cost([0, *c], saved, inputs, cost)[0]
                  for k in range(n) for c in itertools.combinations(range(1, n), k))
        cases.append((saved, inputs, cost, rng.randrange(low, sum(saved) + 1)))
    return cases


def _starts_ok(got, n) -> bool:
    return (isinstance(got, list) and bool(got) and all(type(i) is int for i in got)
            and got[0] == 0 and all(a < b for a, b in zip(got, got[1:])) and got[-1] < n)


def _accepted(plan, want, saved, inputs, cost, budget) -> bool:
    """Whether `plan` passes a case whose reference answer is `want`."""
    if plan is None or want is None:
        return plan is None and want is None
    if not _starts_ok(plan, len(saved)):
        return False
    peak, recompute = checkpointing.plan_cost(plan, saved, inputs, cost)
    best = checkpointing.plan_cost(want, saved, inputs, cost)[1]
    return peak <= budget and abs(recompute - best) <= 1e-9


def _signature(plan, case) -> tuple | None:
    """What a hint matches a plan on: whether it fits and what it recomputes, so that a wrong rule
    with another tie-break gets the same hint."""
    if plan is None or not _starts_ok(plan, len(case[0])):
        return plan if plan is None else ("not starts",)
    peak, recompute = checkpointing.plan_cost(plan, *case[:3])
    return peak <= case[3], round(recompute, 9)


@exercise(points=2, timeout=60.0, reference=("companion.checkpointing.checkpoint_plan",
                                             "companion.checkpointing.segments.checkpoint_plan",
                                             "companion.checkpointing.plan_cost",
                                             "companion.checkpointing.segments.plan_cost"))
def check_checkpoint_plan(answer) -> str:
    """answer(saved, inputs, cost, budget) -> the starts of the segments (0 first) that fit the
    budget with the least recompute, or None when no plan fits."""
    saved_recompute = 0.0
    suspects = list(_PLAN_HINTS)      # the wrong rules that passed every case the answer passed
    for case in _plan_cases(fresh_seeds(1)[0]):
        saved, inputs, cost, budget = case
        label = f"saved={saved}, inputs={inputs}, cost={cost}, budget={budget}"
        want = checkpointing.checkpoint_plan(*case)
        got = call(answer, list(saved), list(inputs), list(cost), budget)
        hint = next((text for wrong, text in suspects
                     if _signature(wrong(*case), case) == _signature(got, case)), "")
        if want is None or got is None:
            require(got is None and want is None, f"{label}: expected {want}, got {got!r}",
                    hint=hint or ("None only when no plan fits: some plan fits this budget, "
                                  "search them all." if want is not None else "no plan fits this budget: "
                                  "return None."))
        else:
            require(_starts_ok(got, len(saved)), f"{label}: {got!r} is not a list of increasing "
                    "int segment starts beginning with 0", hint="return e.g. [0, 3, 5]: segments "
                    "are layers 0-2, 3-4 and 5 to the end.")
            peak, recompute = checkpointing.plan_cost(got, saved, inputs, cost)
            best = checkpointing.plan_cost(want, saved, inputs, cost)[1]
            require(peak <= budget, f"{label}: your plan {got} peaks at {peak} bytes, over the "
                    "budget", hint=hint or "for each segment, count its saved bytes and the "
                    "checkpoints alive during its backward.")
            if abs(recompute - best) > 1e-9:
                raise CheckFailed(f"{label}: your plan {got} recomputes {recompute:g}; {want} "
                                  f"fits with {best:g}", expected=want, got=got, hint=hint)
            saved_recompute += sum(cost[:-1]) - best
        suspects = [(wrong, text) for wrong, text in suspects
                    if _accepted(wrong(*case), want, *case)]
    return ("the least recompute that fits, on uneven layers; a checkpoint after every layer would "
            f"have recomputed {saved_recompute:g} more cost units over these cases")
