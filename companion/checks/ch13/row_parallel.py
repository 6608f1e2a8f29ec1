"""Chapter 13, exercise 1: the row-parallel linear's communication (Megatron's g), run on gloo
ranks and compared with one process: outputs, gradients and the bytes all-reduced.

The answer, `row_parallel_linear(x, weight, bias, group)`, gets its rank's slice of the input
(..., in/t), its columns of the weight (out, in/t) and the whole bias (or None), and returns the
whole output on every rank of `group`; autograd must carry the output's gradient back to the
slices. Each call runs the answer on two launches: one tensor-parallel group of t ranks (t drawn
from 3 and 4), then 4 ranks in two groups of 2 (contiguous or strided, drawn), each group with
its own data, so an answer that talks to the whole world instead of its group fails. On each,
three layers: the row-parallel linear with a bias, without one, and an MLP, column-parallel
then row-parallel (the check's own f before the column layer: identity forward, all-reduce of
the input's gradient backward). Shapes, dtypes (float32, float64) and the MLP's bias are drawn.

Inside each worker only dist.all_reduce goes through, logged with its bytes, the pass
(forward or backward) it ran in, and whether autograd tracked it. As the exercise asks, the
communication must sit in a torch.autograd.Function: an all-reduce autograd tracks (in place on
a tensor that requires grad: c10d has no autograd formula for it, torch only warns) fails, and
so does an output whose graph goes through no Function of the answer's (the all-reduce on
.data, after .detach() or under no_grad: numerically right here, but the gradient's rule is
left unsaid).
"""
from __future__ import annotations

import contextlib
import pickle
import random
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import distributed_c10d as c10d

from companion.checks import _ranks
from companion.checks._collective_guard import _communicating
from companion.checks.core import CheckFailed, compare, exercise, fresh_seeds, require

__all__ = ["check_row_parallel"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_TOLERANCE = {"float32": (1e-4, 1e-5), "float64": (1e-9, 1e-12)}     # (rtol, atol)
_POINT_TO_POINT = ("send", "isend", "recv", "irecv", "batch_isend_irecv")


# ---------------------------------------------------------------- the layers and their data

def _tensors(seed: int, case: dict, dtype: torch.dtype) -> dict:
    """The whole layer's tensors for one group's case, drawn from the seed: the same in the
    parent (the reference) and on every rank of the group."""
    g = torch.Generator().manual_seed(seed)
    lead, n_in, n_out = tuple(case["lead"]), case["in"], case["out"]

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64).mul(scale).to(dtype)
    x = draw(*lead, n_in)
    if case["kind"] == "row":
        out = {"x": x, "weight": draw(n_out, n_in, scale=n_in ** -0.5)}
    else:
        hidden = case["hidden"]
        out = {"x": x, "fc_weight": draw(hidden, n_in, scale=n_in ** -0.5),
               "fc_bias": draw(hidden), "weight": draw(n_out, hidden, scale=hidden ** -0.5)}
    out["bias"] = draw(n_out) if case["bias"] else None
    out["grad"] = draw(*lead, n_out)
    return out


def _column_input(x: torch.Tensor, full: dict, t: int, r: int, f) -> torch.Tensor:
    """The MLP's column-parallel half on rank r of t: gelu(f(x) W1_r^T + b1_r), (..., hidden/t)."""
    return F.gelu(F.linear(f(x), full["fc_weight"].chunk(t, 0)[r], full["fc_bias"].chunk(t, 0)[r]))


def _reference(full: dict, case: dict, t: int) -> dict:
    """One process: the layer's output and the gradients of each rank's slices, by rank."""
    leaves = {k: v.clone().requires_grad_() for k, v in full.items()
              if k != "grad" and v is not None}
    x = leaves["x"]
    h = x if case["kind"] == "row" else F.gelu(F.linear(x, leaves["fc_weight"],
                                                         leaves["fc_bias"]))
    y = F.linear(h, leaves["weight"], leaves.get("bias"))
    y.backward(full["grad"])
    grads = {k: v.grad for k, v in leaves.items()}
    per_rank = []
    for r in range(t):
        want = {"y": y.detach(), "weight.grad": grads["weight"].chunk(t, 1)[r]}
        want["x.grad"] = grads["x"].chunk(t, -1)[r] if case["kind"] == "row" else grads["x"]
        if case["bias"]:
            want["bias.grad"] = grads["bias"]
        per_rank.append(want)
    return {"per_rank": per_rank, "h": h.detach()}


# ---------------------------------------------------------------- inside each worker

class _Log:
    """dist.all_reduce, wrapped: each call appends (bytes, op, tracked) to `calls`, tracked
    when autograd records the call (grad mode on and a tensor that requires grad): c10d's
    all_reduce has no autograd formula, so torch warns and the graph is silently wrong there.
    Inside a torch.autograd.Function's forward grad mode is off."""

    def __init__(self, original):
        self.original, self.calls = original, []

    def __call__(self, tensor, *args, **kwargs):
        op = kwargs.get("op", args[0] if args else dist.ReduceOp.SUM)
        tracked = bool(torch.is_grad_enabled() and getattr(tensor, "requires_grad", False))
        self.calls.append((tensor.numel() * tensor.element_size(), str(op), tracked))
        if tracked:          # judged in the parent, by name: no need for torch's warning too
            return self.original(tensor.detach(), *args, **kwargs)
        return self.original(tensor, *args, **kwargs)


def _refuse(name: str):
    def refuse(*args, **kwargs):
        raise RuntimeError(f"dist.{name} is not an all-reduce: this layer's communication is "
                           "dist.all_reduce(tensor, group=group), nothing else")
    return refuse


@contextlib.contextmanager
def _all_reduce_only(log: _Log) -> Iterator[None]:
    """Inside, dist.all_reduce (and c10d.all_reduce) is `log`; every other collective or
    point-to-point call raises."""
    replaced = {name: _refuse(name) for name in (*_communicating(), *_POINT_TO_POINT)}
    replaced["all_reduce"] = log
    saved = [(module, name, getattr(module, name)) for module in (dist, c10d)
             for name in replaced if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, replaced[name])
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


class _CopyToTP(torch.autograd.Function):
    """The check's f, before the MLP's column layer: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _functions(y: torch.Tensor) -> list[str]:
    """The torch.autograd.Function classes (the answer's, not the check's f) that the output's
    graph goes through."""
    found, seen, todo = [], set(), [y.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, torch.autograd.function.BackwardCFunction) and \
                type(node).__name__ != "_CopyToTPBackward":
            found.append(type(node).__name__.removesuffix("Backward"))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found


def _described(value) -> torch.Tensor | str:
    return value.detach().clone() if isinstance(value, torch.Tensor) else \
        f"a {type(value).__name__}"


def _run_case(answer, log: _Log, full: dict, case: dict, group, t: int, r: int) -> dict:
    """One layer on this rank: the answer's output, its slices' gradients, the all-reduces."""
    slices = {"weight": full["weight"].chunk(t, 1)[r].clone().requires_grad_()}
    if case["bias"]:
        slices["bias"] = full["bias"].clone().requires_grad_()
    x = full["x"].chunk(t, -1)[r] if case["kind"] == "row" else full["x"]
    slices["x"] = x.clone().requires_grad_()
    h = slices["x"]
    if case["kind"] == "mlp":
        h = _column_input(h, full, t, r, lambda v: _CopyToTP.apply(v, group))
    del log.calls[:]
    y = answer(h, slices["weight"], slices.get("bias"), group)
    result = {"y": _described(y), "forward": list(log.calls), "error": None,
              "functions": _functions(y) if isinstance(y, torch.Tensor) else []}
    del log.calls[:]
    if isinstance(y, torch.Tensor):
        try:
            y.backward(full["grad"])
        except NotImplementedError:
            raise
        except Exception as e:
            result["error"] = f"{type(e).__name__}: {e}"
    result["backward"] = list(log.calls)
    for name, leaf in slices.items():
        result[f"{name}.grad"] = None if leaf.grad is None else leaf.grad.clone()
    return result


def _tp_worker(rank: int, world: int, packed: bytes, seed: int, spec: dict) -> list[dict]:
    groups = [dist.new_group(ranks) for ranks in spec["groups"]]     # every rank makes each
    mine = next(i for i, ranks in enumerate(spec["groups"]) if rank in ranks)
    t, r = len(spec["groups"][mine]), spec["groups"][mine].index(rank)
    log, dtype, results = _Log(dist.all_reduce), _DTYPES[spec["dtype"]], []
    with _all_reduce_only(log):
        answer = pickle.loads(packed)          # imported after patching: `from dist import ...`
        for k, case in enumerate(spec["cases"]):
            full = _tensors(_case_seed(seed, mine, k), case, dtype)
            results.append(_run_case(answer, log, full, case, groups[mine], t, r))
    return results


def _case_seed(seed: int, group: int, k: int) -> int:
    return seed + 1009 * group + 7919 * k


# ---------------------------------------------------------------- judging, in the parent

def _spec(rng: random.Random, groups: list[list[int]], dtype: str) -> dict:
    t = len(groups[0])

    def lead():
        return [rng.randrange(1, 4), rng.randrange(2, 6)] if rng.random() < 0.5 else \
            [rng.randrange(3, 9)]
    cases = [{"kind": "row", "bias": True, "lead": lead(), "in": t * rng.randrange(2, 6),
              "out": rng.randrange(3, 12)},
             {"kind": "row", "bias": False, "lead": lead(), "in": t * rng.randrange(2, 6),
              "out": rng.randrange(3, 12)},
             {"kind": "mlp", "bias": rng.random() < 0.5, "lead": lead(),
              "in": rng.randrange(3, 10), "hidden": t * rng.randrange(2, 6),
              "out": rng.randrange(3, 12)}]
    return {"groups": groups, "dtype": dtype, "cases": cases}


def _known_wrong(full: dict, ref: dict, case: dict, t: int, r: int, what: str) -> dict:
    """Values a likely mistake gives for `what` on rank r, keyed by the hint that names it."""
    weights = full["weight"].chunk(t, 1)
    bias = full["bias"] if case["bias"] else torch.zeros((), dtype=weights[0].dtype)
    partial = F.linear(ref["h"].chunk(t, -1)[r], weights[r])
    want = ref["per_rank"][r][what]
    if what == "y":
        return {"each rank added the bias before the all-reduce, so the sum holds it t times: "
                "add it once, to the summed output.": want + (t - 1) * bias,
                "the output is this rank's partial sum alone: the forward must all-reduce the "
                "partial sums over the group.": partial + bias,
                "the output is the mean of the partial sums: all-reduce sums them, and the "
                "layer's output is that sum.": (want - bias) / t + bias}
    wrong = {"the gradients are t times too large: the output's gradient was all-reduced in "
             "backward too. Each rank already has the whole gradient of the output; the "
             "backward of the forward's all-reduce passes it on as it is.": want * t,
             "the gradients are t times too small: the backward divides by t, but the forward "
             "was a sum, whose gradient reaches every term whole.": want / t}
    if what == "x.grad" and case["kind"] == "row":
        sums = sum(F.linear(full["grad"], w.T) for w in weights)
        wrong["the input's gradient was all-reduced: each rank's input is its own slice, and "
              "its gradient is that slice's alone (grad_y @ W_r), not a sum over the "
              "ranks."] = sums
    return wrong


def _judge(results: list[list[dict]], spec: dict, seed: int, where: str) -> None:
    rtol, atol = _TOLERANCE[spec["dtype"]]
    dtype = _DTYPES[spec["dtype"]]
    for mine, ranks in enumerate(spec["groups"]):
        t = len(ranks)
        for k, case in enumerate(spec["cases"]):
            full = _tensors(_case_seed(seed, mine, k), case, dtype)
            ref = _reference(full, case, t)
            layer = (f"{'the row-parallel linear' if case['kind'] == 'row' else 'the MLP'} "
                     f"({'with' if case['bias'] else 'without'} bias, input "
                     f"{tuple(case['lead']) + (case['in'],)}, {spec['dtype']}) on t = {t} "
                     f"ranks{where}")
            for r, rank in enumerate(ranks):
                _judge_rank(results[rank][k], full, ref, case, t, r, f"rank {rank}, {layer}",
                            rtol, atol, _GROUP_HINT if len(spec["groups"]) > 1 else "")


_GROUP_HINT = ("here the 4 ranks form two tensor-parallel groups, each with its own data: "
               "all-reduce over the group the layer is given (group=group), not over every rank.")


def _judge_rank(got: dict, full: dict, ref: dict, case: dict, t: int, r: int, where: str,
                rtol: float, atol: float, hint: str) -> None:
    want = ref["per_rank"][r]
    require(isinstance(got["y"], torch.Tensor), f"{where}: expected the output tensor, got "
            f"{got['y']}", hint="return the layer's output (the sum over the group, plus the "
            "bias).")
    compare(got["y"], want["y"], name=f"{where}: the output", rtol=rtol, atol=atol, hint=hint,
            known_wrong=_known_wrong(full, ref, case, t, r, "y"))
    require(got["error"] is None, f"{where}: backward raised {got['error']}",
            hint="dist.all_reduce is invisible to autograd: put it in the forward of a "
                 "torch.autograd.Function whose backward returns the gradient for each of "
                 "forward's inputs (None for the group).")
    for name in want:
        if name == "y":
            continue
        require(got[name] is not None, f"{where}: {name} is None after backward: the output "
                f"does not depend on {name.split('.')[0]} through autograd",
                hint="an all-reduce in place on a tensor autograd does not track (or under "
                     "torch.no_grad) cuts the graph: return the output of your "
                     "torch.autograd.Function.")
        compare(got[name], want[name], name=f"{where}: {name}", rtol=rtol, atol=atol, hint=hint,
                known_wrong=_known_wrong(full, ref, case, t, r, name))
    _judge_function(got, where)
    _judge_traffic(got, full, case, where)


def _judge_function(got: dict, where: str) -> None:
    """The forward's all-reduce inside a torch.autograd.Function, as the exercise asks."""
    require(not any(tracked for *_, tracked in got["forward"]),
            f"{where}: dist.all_reduce ran in place on a tensor autograd tracks, outside a "
            "torch.autograd.Function: c10d's all_reduce has no autograd formula, so torch only "
            "warns (\"an autograd kernel was not registered ... silently incorrect behavior\", "
            "deprecated) and the gradients are right here by luck, not by design",
            hint="put the all-reduce in the forward of a torch.autograd.Function "
                 "(ReduceFromTP) and say in its backward what the sum's gradient is.")
    require(bool(got["functions"]), f"{where}: the output's autograd graph goes through no "
            "torch.autograd.Function: the all-reduce was done where autograd does not see it "
            "(on .data, after .detach() or under torch.no_grad), and the backward is right "
            "only because nothing stands for it",
            hint="the exercise asks for the communication in a torch.autograd.Function "
                 "(ReduceFromTP): all-reduce in its forward, and its backward returns the "
                 "gradient the sum passes on.")


def _judge_traffic(got: dict, full: dict, case: dict, where: str) -> None:
    """Forward: one all-reduce of the (..., out) partial sums; backward: none in the row layer
    (the MLP's one is the check's f, of the (..., in) input's gradient)."""
    e = full["x"].element_size()
    lead = full["x"].numel() // case["in"]
    out_bytes, in_bytes = lead * case["out"] * e, lead * case["in"] * e
    forward = [b for b, *_ in got["forward"]]
    require(forward == [out_bytes], f"{where}: the forward all-reduced {len(forward)} tensor(s) "
            f"of {forward} bytes; the layer needs one all-reduce of its partial sums, "
            f"{out_bytes} bytes", hint="all-reduce the product x W^T once, before the bias; "
                                       "nothing else in forward.")
    ops = {op for _, op, _ in got["forward"]}
    require(ops <= {str(dist.ReduceOp.SUM)}, f"{where}: the forward all-reduced with {ops}",
            hint="the partial sums add up: op=dist.ReduceOp.SUM (the default).")
    backward = [b for b, *_ in got["backward"]]
    expected = [] if case["kind"] == "row" else [in_bytes]
    require(backward == expected, f"{where}: backward all-reduced {backward} bytes; "
            f"expected {expected}" + (" (the column layer's f, of the input's gradient)"
                                      if expected else ""),
            hint="the row-parallel layer's backward sends nothing: each rank holds the whole "
                 "gradient of the output already.")


@exercise(points=2, timeout=120.0, reference=("companion.tensor_parallel.reduce_from_tp",
                                              "companion.tensor_parallel._ReduceFromTP",
                                              "companion.tensor_parallel.RowParallelLinear",
                                              "companion.tensor_parallel.tp_mlp",
                                              "companion.tensor_parallel.TensorParallelBlock"))
def check_row_parallel(answer, *, worker_timeout: float = 30.0) -> str:
    """answer(x, weight, bias, group) -> the whole output: x is this rank's (..., in/t) slice,
    weight its (out, in/t) columns, bias the whole (out,) or None."""
    packed, seed = _ranks.packed(answer), fresh_seeds(1)[0]
    rng = random.Random(seed)
    t = rng.choice([3, 4])
    first, second = rng.sample(sorted(_DTYPES), 2)
    split = [[0, 1], [2, 3]] if rng.random() < 0.5 else [[0, 2], [1, 3]]
    runs = [(t, _spec(rng, [list(range(t))], first), ""),
            (4, _spec(rng, split, second), f" (4 ranks in groups {split})")]
    for world, spec, where in runs:
        results = _ranks.on_ranks(_tp_worker, world, packed, seed, spec, timeout=worker_timeout)
        _judge(results, spec, seed, where)
    case = runs[0][1]["cases"][0]
    lead = 1
    for n in case["lead"]:
        lead *= n
    S = lead * case["out"] * torch.empty((), dtype=_DTYPES[first]).element_size()
    return (f"equal to one process on t = {t} and 2 (outputs, and the gradients of each rank's "
            f"slices), for a row-parallel linear with and without bias and an MLP; one "
            f"all-reduce per layer forward and none in its backward: at t = {t} a "
            f"{S}-byte output costs each rank 2(t-1)/t·S = {2 * (t - 1) * S / t:.0f} bytes "
            f"sent on a ring")
