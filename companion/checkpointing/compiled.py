"""The compiler's choice: what `torch.compile` keeps for backward under an activation memory budget.

AOTAutograd traces forward and backward into one joint graph, and a partitioner cuts it in two:
what crosses the cut is what the compiled forward saves. `torch.compile`'s partitioner,
`min_cut_rematerialization_partition` (torch/_functorch/partitioners.py), takes the cut of fewest
bytes among those that recompute only cheap ops in backward (pointwise ops, reductions, views),
never matmuls, attention kernels or random ops. `torch._functorch.config.activation_memory_budget`
trades memory for recompute: 1 (the default) is that cut; 0 saves only the graph's inputs (the
parameters and x: the whole region recomputed, like a whole-block checkpoint); in between, a 0-1
knapsack over the ops it had banned (`activation_memory_budget_solver` "dp", priced by
`activation_memory_budget_runtime_estimator` "flops") keeps the bytes saved beyond the inputs
under `budget` times those of the cut at 1. Below 1 it may recompute random ops too, with fresh
draws: dropout's backward then uses another mask (pytorch/pytorch#190758; measured here at 0).

Which backends apply it: those whose partition function is the min-cut one; in torch 2.13
`inductor`, `aot_eager` and `aot_eager_decomp_partition` (torch/_dynamo/backends/debugging.py),
not `aot_eager_default_partitioner`. The default here, `aot_eager_decomp_partition`, applies
inductor's decompositions first and runs the partitioned graphs op by op: on the course's GPT
block it saved the very tensors inductor saved (budgets 0, 0.25, 0.5, 1), compiling in about a
second where inductor took 8 to 46 s on a 2-core CPU. Op by op, `companion.memory.track` sees
every tensor; inductor's code allocates its buffers outside PyTorch's dispatcher, so for it the
bytes are those of the saved tensors alone.

Example:
    >>> run = compiled_saved(block, x, budget=0.5)
    >>> run.saved_bytes, run.saved_shapes, run.compile_seconds
    >>> curve = budget_curve(block, x, budgets=(0, 0.5, 1))  # with eager, checkpoint and fit

Simplified vs torchtitan's memory-budget runs: one block, not a model; one global budget per
compile (torch 2.13 also has `region_activation_memory_budget` for regions of a graph); step
times of the partitioned graphs run op by op, without inductor's fused kernels.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

import torch
from torch.utils._pytree import tree_leaves

from companion.checkpointing.budget import region_ops
from companion.checkpointing.budget_run import checkpoint_with_plan, fit
from companion.cost.clock import now
from companion.cost.stats import interleave
from companion.memory import track

__all__ = ["TRACKED_BACKENDS", "CompiledSaved", "compiled_saved", "compiled_step", "BudgetPoint",
           "BudgetCurve", "budget_curve"]

# Backends whose compiled code allocates through the dispatcher, so that `track` counts it.
TRACKED_BACKENDS = ("aot_eager", "aot_eager_decomp_partition")


@dataclasses.dataclass(frozen=True)
class CompiledSaved:
    """What one compile at one budget keeps for backward, in bytes beyond the input, the output
    and the parameters (all three held by the caller anyway)."""

    backend: str
    budget: float
    saved_bytes: int        # track: held after the compiled forward (inductor: = listed_bytes)
    listed_bytes: int       # distinct storages of the compiled backward's saved tensors
    saved_shapes: tuple[tuple[int, ...], ...]   # those saved tensors, in the graph's order
    compile_seconds: float  # wall seconds of the first forward and backward, which compile


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors
            if isinstance(t, torch.Tensor)}


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _grads(outs: list[torch.Tensor], wrt: list[torch.Tensor]) -> tuple:
    outs = [t for t in outs if t.requires_grad]
    return torch.autograd.grad(outs, wrt, [torch.ones_like(t) for t in outs], allow_unused=True)


def _check(block, x, budget, backend) -> list[torch.Tensor]:
    if not callable(block):
        raise TypeError(f"block is a module or function to compile, got {type(block).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x is the block's input tensor, got {type(x).__name__}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError(f"budget is activation_memory_budget, a number from 0 (recompute all "
                         f"it can) to 1 (torch.compile's default), got {budget!r}")
    try:
        torch._dynamo.lookup_backend(backend)
    except Exception as error:                   # torch._dynamo.exc.InvalidBackend
        raise ValueError(f"backend {backend!r} is not a torch.compile backend; the ones that "
                         f"apply the budget: {', '.join(TRACKED_BACKENDS)}, inductor") from error
    params = list(block.parameters()) if isinstance(block, torch.nn.Module) else []
    wrt = ([x] if x.requires_grad else []) + [p for p in params if p.requires_grad]
    if not wrt:
        raise ValueError("nothing requires grad, so backward saves nothing: pass x with "
                         "requires_grad=True or a module with trainable parameters")
    return wrt


def _compile(block, x, budget: float, backend: str) -> tuple[CompiledSaved, Callable]:
    """Compile `block` at `budget`, check it against eager, measure what it saves; also return
    one compiled step (forward and backward, through the compiled graphs, no Dynamo guards)."""
    wrt = _check(block, x, budget, backend)
    captured = {}

    def capture(gm, example_inputs):         # Dynamo hands over the graph and its real inputs
        captured["fn"] = torch._dynamo.lookup_backend(backend)(gm, example_inputs)
        captured["args"] = list(example_inputs)
        return captured["fn"]

    # 1. Compile afresh at this budget: no Dynamo cache, no on-disk graph cache from an earlier
    #    budget; the config patches are undone on leaving, even after an error.
    torch._dynamo.reset()
    try:
        with torch._functorch.config.patch(activation_memory_budget=float(budget),
                                           enable_autograd_cache=False), \
                torch._inductor.config.patch(fx_graph_cache=False):
            start = now(x.device)                                     # host-device sync
            y = torch.compile(block, backend=capture, fullgraph=True)(x)
            outs = [t for t in _tensors(y) if t.requires_grad]
            if not outs:
                raise ValueError("the block's output does not require grad: backward saves "
                                 "nothing; return a tensor computed from x or the parameters")
            grads = _grads(outs, wrt)                                 # backward compiles here
            seconds = now(x.device) - start                           # host-device sync
    except torch._dynamo.exc.Unsupported as error:
        raise RuntimeError(f"the block does not compile as one graph (fullgraph=True), so no "
                           f"one partition holds it; remove the graph break: {error}") from error
    finally:
        torch._dynamo.reset()                # a later torch.compile(block) compiles anew
    # 2. The same numbers as eager.
    try:
        torch.testing.assert_close(y, block(x))
        for got, want in zip(grads, _grads(_tensors(block(x)), wrt)):
            if want is not None or got is not None:     # sums over the batch, reordered by the
                scale = float(want.abs().max()) if want is not None else 1.0   # decompositions:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * max(scale, 1.0))
    except AssertionError as error:
        raise AssertionError(f"the compiled block (budget {budget}, {backend}) differs from "
                             "eager. A block that draws random numbers (dropout) draws "
                             "differently compiled: measure it in eval() mode (and note that "
                             "below budget 1 torch may recompute random ops with fresh draws, "
                             f"pytorch/pytorch#190758).\n{error}") from None
    # 3. Measure one compiled forward: what it holds beyond its output (x and the parameters
    #    were made before `track` started), and what its backward node lists as saved.
    fn, args = captured["fn"], captured["args"]
    callers = _storages(args)                  # x and the parameters
    with track(x.device) as tracker:
        outs = _tensors(fn(*args))
        made = {k: n for k, n in _storages(outs).items() if k not in callers}
        held = tracker.current - sum(made.values())
    node = next((t.grad_fn for t in outs if t.grad_fn is not None), None)
    saved = [t for t in (node.saved_tensors if node is not None else ())
             if t.untyped_storage()._cdata not in callers.keys() | made.keys()]
    listed, shapes = sum(_storages(saved).values()), tuple(tuple(t.shape) for t in saved)
    run = CompiledSaved(backend, float(budget), held if backend in TRACKED_BACKENDS else listed,
                        listed, shapes, seconds)
    return run, lambda: _grads(_tensors(fn(*args)), wrt)


def compiled_saved(block: Callable, x: torch.Tensor, *, budget: float,
                   backend: str = "aot_eager_decomp_partition") -> CompiledSaved:
    """Compile `block` with `torch.compile(backend=backend)` under
    `activation_memory_budget=budget` and measure what its forward keeps for backward.

    Memory: `saved_bytes`, measured by `companion.memory.track` around one compiled forward:
    the bytes alive after it, less its output (the caller's), x and the parameters not counted
    (made before); `saved_shapes` and `listed_bytes`: the activations its backward node
    (`CompiledFunctionBackward`) saved, parameters and x left out. Cost: one compile, checked
    against eager (outputs and gradients `assert_close`); Dynamo is reset before and after it,
    so every torch.compile'd function in the process compiles again on its next call.

        >>> run = compiled_saved(block, x, budget=0.0)   # recompute all: run.saved_bytes == 0
        >>> len(run.saved_shapes), run.compile_seconds

    Raises AssertionError when the compiled outputs or gradients differ from eager's."""
    return _compile(block, x, budget, backend)[0]


def compiled_step(block: Callable, x: torch.Tensor, *, budget: float,
                  backend: str = "aot_eager_decomp_partition") -> tuple[CompiledSaved, Callable]:
    """`compiled_saved`'s measurement and a step to time: a function that runs the compiled
    forward and backward once and returns the gradients (of x and the parameters).

        >>> run, step = compiled_step(block, x, budget=0.5)
        >>> times = interleave({"compiled": step, "eager": ...})"""
    return _compile(block, x, budget, backend)


@dataclasses.dataclass(frozen=True)
class BudgetPoint:
    """One budget: the compiled block, and the per-op solver (`fit`) at the same bytes."""

    compiled: CompiledSaved
    compiled_ms: float      # median step (forward + backward) of the compiled graphs
    fit_bytes: int          # fit's measured bytes, asked for compiled.saved_bytes (same basis)
    fit_ms: float           # median step of fit's plan through checkpoint_with_plan

    @property
    def budget(self) -> float:
        return self.compiled.budget


@dataclasses.dataclass(frozen=True)
class BudgetCurve:
    """`budget_curve`'s answer: a point per budget, and eager's two ends beside them. Bytes are
    held between forward and backward beyond the input, the output and the parameters."""

    points: tuple[BudgetPoint, ...]
    eager_bytes: int        # plain autograd: save everything
    eager_ms: float
    checkpoint_bytes: int   # whole-block checkpoint: recompute everything (keeps only x)
    checkpoint_ms: float
    times: dict[str, list[float]]   # every timed step ("eager", "checkpoint", "compiled 0.5",
                                    # "fit 0.5"), for companion.cost.stats.compare


def _held(run: Callable[[], object], device) -> int:
    """Bytes alive after `run()` (a forward) less its output's new storages."""
    with track(device) as tracker:
        out = _tensors(run())
        return tracker.current - sum(_storages(out).values())


def budget_curve(block: Callable, x: torch.Tensor, budgets: Sequence[float] = (0, .25, .5, .75, 1),
                 *, backend: str = "aot_eager_decomp_partition", rounds: int = 5) -> BudgetCurve:
    """Saved bytes and step time of `block` compiled at each budget, beside plain autograd (save
    everything), a whole-block checkpoint (recompute everything) and our per-op solver (`fit`)
    asked for the compiled point's bytes, so that a plot holds all of them.

    Cost: one compile per budget (`compiled_saved`; its seconds are in each point), one `fit`
    per budget (a plain forward and a checkpointed step or a few), then `rounds` rounds of
    `companion.cost.stats.interleave`d steps of every contender (medians kept, all in `times`).

        >>> curve = budget_curve(block, x, budgets=(0, 0.5, 1))
        >>> [(p.budget, p.compiled.saved_bytes, p.fit_bytes) for p in curve.points]

    Simplified: step times exclude Dynamo's guard checks (the compiled graphs are called
    directly), and no optimizer step."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds is how many timed rounds, an int >= 1; got {rounds!r}")
    if not isinstance(budgets, (list, tuple)) or not budgets or len(set(budgets)) < len(budgets):
        raise ValueError("budgets are a list or tuple of distinct values from 0 to 1, e.g. "
                         f"(0, 0.5, 1); got {budgets!r}")
    wrt = [_check(block, x, budget, backend) for budget in budgets][0]
    budgets = [float(budget) for budget in budgets]     # times' keys: "compiled 0.5", "fit 0.5"
    steps = {"eager": lambda: _grads(_tensors(block(x)), wrt),
             "checkpoint": lambda: _grads(_tensors(torch.utils.checkpoint.checkpoint(
                 block, x, use_reentrant=False)), wrt)}
    eager_bytes = _held(lambda: block(x), x.device)
    checkpoint_bytes = _held(lambda: torch.utils.checkpoint.checkpoint(block, x,
                                                                       use_reentrant=False),
                             x.device)
    inputs = region_ops(block, x).input_bytes          # fit counts x; the curve does not
    runs, fitted = [], []
    for budget in budgets:
        run, steps[f"compiled {budget}"] = _compile(block, x, budget, backend)
        fitted.append(fit(block, (x,), inputs + run.saved_bytes))
        steps[f"fit {budget}"] = (lambda plan=fitted[-1].plan: _grads(_tensors(
            checkpoint_with_plan(block, x, plan=plan)), wrt))
        runs.append(run)
    times = interleave(steps, rounds=rounds, clock=lambda: now(x.device))
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    points = tuple(BudgetPoint(run, ms[f"compiled {b}"], f.measured_bytes - inputs, ms[f"fit {b}"])
                   for b, run, f in zip(budgets, runs, fitted))
    return BudgetCurve(points, eager_bytes, ms["eager"], checkpoint_bytes, ms["checkpoint"], times)
