"""Checks for chapter 04, gradient checkpointing."""
from __future__ import annotations

import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from companion import checkpointing, models
from companion.checks.core import (CheckFailed, call, compare, exercise, fresh_seeds, harness,
                                   require)
from companion.memory import format_bytes, track

__all__ = ["check_saved_bytes", "check_checkpoint_function", "check_selective_policy",
           "check_segments_for_budget"]


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
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(7, width, generator=g, requires_grad=True)
        block = _block(seed, width, 0.0)
        cases = [(block, "an MLP block"), (_square, "x * x"),
                 (_sigmoid_exp_matmul, "sigmoid, exp, matmul"),
                 (_slices_product, "two slices of one tensor, multiplied")]
        for fn, label in cases:
            got = call(answer, fn, x)
            saved = checkpointing.saved_for_backward(fn, x)
            with_params = sum({s.storage: s.storage_nbytes for s in saved}.values())
            every_save = sum(s.nbytes for s in saved if not s.is_parameter)
            compare(got, checkpointing.activation_bytes(fn, x), name=f"bytes saved by {label}",
                    hint="pack every tensor with torch.autograd.graph.saved_tensors_hooks and add "
                         "t.untyped_storage().nbytes() for each new storage.",
                    known_wrong={
                        "a tensor saved twice (x * x saves x twice, and a ReLU's output is saved "
                        "again by the next Linear) exists once: count each storage once "
                        "(t.untyped_storage().data_ptr()).": every_save,
                        "leave out the parameters: the weights are in memory anyway, with or "
                        "without backward (compare storages with fn.parameters()).": with_params,
                        "a saved view keeps its whole storage alive: count "
                        "t.untyped_storage().nbytes(), not the first view's numel() * "
                        "element_size() (two slices of one tensor hold all of it).":
                            _first_view_bytes(fn, x),
                        "views of one tensor share its storage: tell storages apart by "
                        "t.untyped_storage().data_ptr(), not t.data_ptr() (a slice starts "
                        "elsewhere in the same storage).": _view_bytes(fn, x),
                    })
    return "you can see what autograd keeps: the inputs of each layer, not the weights"


def _gradients(fn_wrapper, block, x, seed):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
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


def _input(seed: int, width: int) -> torch.Tensor:
    return torch.randn(5, width, generator=torch.Generator().manual_seed(seed), requires_grad=True)


@harness
def _checkpoint_forward(answer, seed: int, width: int, p: float) -> tuple[int, int]:
    """(bytes the answer's forward keeps for backward, how many times it ran fn)."""
    block, calls = _block(seed, width, p), []
    counted = lambda t: (calls.append(1), block(t))[1]
    torch.manual_seed(seed)
    kept = checkpointing.activation_bytes(lambda t: call(answer, counted, t), _input(seed, width))
    return kept, len(calls)


@harness
def _checkpoint_backward(answer, seed: int, width: int, p: float) -> tuple[tuple, int]:
    """((output, gradients) through the answer, how many times fn ran in forward and backward)."""
    block, calls = _block(seed, width, p), []
    counted = lambda t: (calls.append(1), block(t))[1]
    got = _gradients(lambda m, t: call(answer, counted, t), block, _input(seed, width), seed)
    return got, len(calls)


@harness
def _random_after_backward(answer, seed: int, width: int) -> torch.Tensor:
    """torch.rand after a backward through two stacked checkpointed blocks with dropout (the
    answer's, or plain autograd's when answer is None): a checkpoint must leave the caller's
    random stream where plain autograd leaves it."""
    first, second = _block(seed, width, 0.5), _block(seed + 1, width, 0.5)
    run = (lambda fn, t: fn(t)) if answer is None else (lambda fn, t: call(answer, fn, t))
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
    x requires grad; fn may use dropout."""
    saved_plain = saved_mine = 0
    seeds = fresh_seeds(3)
    for seed, width, p in zip(seeds, [6, 11, 16], [0.0, 0.5, 0.3]):
        block, x = _block(seed, width, p), _input(seed, width)
        mine_saved, calls = _checkpoint_forward(answer, seed, width, p)
        require(calls == 1, f"fn ran {calls} times in forward; expected once",
                hint="forward runs fn once, under torch.no_grad().")
        plain_saved = checkpointing.activation_bytes(block, x)
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
        want = _gradients(lambda m, t: m(t), block, x, seed)
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
    compare(_random_after_backward(answer, seeds[0], 7), _random_after_backward(None, seeds[0], 7),
            name="torch.rand(8) after backward through two stacked checkpoints",
            hint="restore the saved random state inside `with torch.random.fork_rng():`, so the "
                 "recomputation does not rewind the random stream of the code around backward.")
    return (f"same gradients as plain autograd, random stream left as it was; saved for backward "
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


_POLICY_HINTS = {
    "keep": "keep what nn.Linear computes, aten.mm and aten.addmm: the expensive matrix "
            "multiplies, costly to run again.",
    "bmm": "aten.bmm here is attention's q·kᵀ and weights·v: it reads and writes (T, T) "
           "tensors that grow with the square of the sequence, and costs little to redo; "
           "recompute it.",
    "other": "element-wise operators, softmax and LayerNorm are cheap: recompute them, keep "
             "only the Linear layers' outputs.",
}


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


@exercise(points=2, timeout=30.0, reference="companion.checkpointing.save_linear_outputs")
def check_selective_policy(answer) -> str:
    """answer(op) -> bool: True to keep the output of the aten operator `op` in forward, False to
    recompute it in backward. Keep what nn.Linear computes; recompute the rest."""
    kept = {"plain": 0, "full": 0, "yours": 0}
    for seed, (width, heads, T) in zip(fresh_seeds(2), [(24, 3, 13), (40, 5, 9)]):
        torch.manual_seed(seed)
        block = torch.nn.Sequential(models.Block(width, heads),       # every Linear with a bias,
                                    torch.nn.Linear(width, width, bias=False))   # and one without
        x = torch.randn(3, T, width, generator=torch.Generator().manual_seed(seed),
                        requires_grad=True)
        # 1. Ask the policy about every operator the block runs, outside autograd's hooks.
        with _Operators() as seen:
            block(x)
        table = {}
        for op in seen.ops:
            keep = call(answer, op)
            require(isinstance(keep, bool), f"policy({op}) returned {keep!r}, not True or False",
                    hint="return a bool: True keeps the operator's output, False recomputes it.")
            table[op] = keep
        require(not all(table.values()), "your policy keeps every operator's output",
                hint="keeping everything saves nothing, it is plain autograd with extra steps: "
                     "keep only aten.mm and aten.addmm, what nn.Linear computes.")
        for op, keep in table.items():
            want = checkpointing.save_linear_outputs(op)
            if keep != want:
                key = "keep" if want else "bmm" if op.overloadpacket == torch.ops.aten.bmm else "other"
                raise CheckFailed(f"your policy {'keeps' if keep else 'recomputes'} {op}",
                                  expected=want, got=keep, hint=_POLICY_HINTS[key])
        # 2. Same gradients as no checkpointing, with the policy's table in charge (views: False).
        yours = lambda op: table.get(op, False)
        compare(_block_gradients(block, x, yours), _block_gradients(block, x, False),
                name="(parameter and input gradients)")
        for name, policy in (("plain", False), ("full", None), ("yours", yours)):
            kept[name] += _kept_bytes(block, x, policy)
    return (f"kept between forward and backward: plain {format_bytes(kept['plain'])}, full "
            f"recompute {format_bytes(kept['full'])}, your policy {format_bytes(kept['yours'])} "
            "(the Linear outputs: no matrix multiply of a Linear runs twice)")


_CEIL_HINT = ("the longest segment is the last one, n - (n // s)·(s - 1) layers "
              "(checkpoint_sequential gives it the remainder), not ceil(n / s).")


def _segment_mistakes(n: int, unit: int, budget: int) -> dict[str, int]:
    """What the likely wrong rules answer, by hint (rules with no answer left out)."""
    first = lambda fits: next((s for s in range(1, n + 1) if fits(s)), None)
    wrong = {
        "the inputs of the checkpointed segments stay in memory too: add "
        "(segments - 1) · layer_bytes.": first(lambda s: -(-n // s) * unit <= budget),
        _CEIL_HINT: first(lambda s: (s - 1 + -(-n // s)) * unit <= budget),
        "√n gives the smallest peak, but fewer segments recompute less: return "
        "the fewest that fit.": checkpointing.sqrt_segments(n),
    }
    return {hint: s for hint, s in wrong.items() if s is not None}


@exercise(points=1, reference=("companion.checkpointing.segments_for_budget",
                               "companion.checkpointing.predicted_activation_units",
                               "companion.checkpointing.predicted_activation_bytes"))
def check_segments_for_budget(answer) -> str:
    """answer(n_layers, layer_bytes, budget_bytes) -> int or None: the fewest segments whose
    predicted peak, ((segments - 1) + longest segment) · layer_bytes, fits the budget."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = [(16, 1000, 16000), (16, 1000, 7000), (16, 1000, 6999), (1, 10, 10), (1, 10, 9),
             (26, 1000, 10000), (11, 1000, 6000)]   # the last segment takes the remainder
    for _ in range(8):
        n, unit = rng.randrange(2, 120), rng.randrange(1, 5000)
        cases.append((n, unit, rng.randrange(unit, n * unit + 1)))
    for n, unit, budget in cases:
        got = call(answer, n, unit, budget)
        want = checkpointing.segments_for_budget(n, unit, budget)
        label = f"segments for n={n}, layer_bytes={unit}, budget={budget}"
        mistakes = _segment_mistakes(n, unit, budget)
        if want is None or got is None:
            hint = ("return None only when no segment count fits, not even the best near √n."
                    if want is not None else _CEIL_HINT if got == mistakes.get(_CEIL_HINT)
                    else "near √n segments the peak is smallest; if even that does not fit, "
                         "return None.")
            require(got is want, f"{label}: expected {want}, got {got!r}", hint=hint)
            continue
        compare(got, want, name=label, known_wrong=mistakes,
                hint="try 1, 2, 3, ... segments and return the first whose peak fits.")
    return "the fewest segments that fit, so the least recompute for the memory you have"
