"""torch.compile under activation_memory_budget (companion.checkpointing.compiled): what the
compiled forward keeps, measured by `track` and read from the compiled backward's saved tensors,
against eager's two ends (plain autograd, whole-block checkpoint); outputs and gradients equal to
eager's; budget_curve with the per-op solver beside it. The checks fail known-wrong measurements
(the output, x or the parameters counted as saved, a budget ignored) and blocks that compile to
other numbers. Backends: aot_eager and aot_eager_decomp_partition (inductor compiles too slowly
for a unit test on this CPU: 8-46 s a budget)."""
import dataclasses

import pytest
import torch
from torch import nn

from companion.checkpointing import budget_curve, compiled_saved
from companion.memory import track
from companion.models import GPT, Llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt():
    return GPT(64, 16, 32, 1, 4, seed=0).blocks[0]


def _llama():
    return Llama(64, 16, 32, 1, 4, kv_heads=2, intermediate=64, seed=0).blocks[0]


def _x(seed=0, width=32):
    return torch.randn(2, 16, width, generator=torch.Generator().manual_seed(seed),
                       requires_grad=True)


def _held(forward) -> int:
    with track() as t:
        y = forward()
        return t.current - y.untyped_storage().nbytes()


def _check_measurements(runs, eager_bytes, checkpoint_bytes):
    """What a right measurement satisfies: budget 0 saves only the inputs (nothing beyond x and
    the parameters, as a whole-block checkpoint), budget 1 something and no more than eager,
    and track agrees with the compiled backward's own list of saved tensors."""
    zero, one = runs[0.0], runs[1.0]
    assert zero.saved_bytes == checkpoint_bytes == 0 and zero.saved_shapes == ()
    assert 0 < one.saved_bytes <= eager_bytes
    assert zero.saved_bytes <= one.saved_bytes
    for run in runs.values():
        assert run.saved_bytes == run.listed_bytes


CASES = {"gpt-aot_eager": (_gpt, "aot_eager"),
         "gpt-decomp": (_gpt, "aot_eager_decomp_partition"),
         "llama-decomp": (_llama, "aot_eager_decomp_partition")}


@pytest.fixture(scope="module", params=list(CASES))
def measured(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    make, backend = CASES[request.param]
    block, x = make(), _x()
    runs = {b: compiled_saved(block, x, budget=b, backend=backend) for b in (0.0, 1.0)}
    eager = _held(lambda: block(x))
    checkpoint = _held(lambda: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
    torch.set_num_threads(threads)
    return runs, eager, checkpoint, block, x


def test_budget_zero_keeps_only_the_inputs_and_no_more_than_budget_one(measured):
    runs, eager, checkpoint, block, x = measured
    _check_measurements(runs, eager, checkpoint)
    one = runs[1.0]
    assert all(isinstance(s, tuple) for s in one.saved_shapes) and len(one.saved_shapes) > 3
    assert one.compile_seconds > 0 and one.backend in ("aot_eager", "aot_eager_decomp_partition")


def _with(runs, delta):
    return {b: dataclasses.replace(r, saved_bytes=r.saved_bytes + delta) for b, r in runs.items()}


@pytest.mark.parametrize("wrong", ["output counted", "x counted", "parameters counted",
                                   "budget ignored", "saved list half read"])
def test_the_check_fails_known_wrong_measurements(measured, wrong):
    runs, eager, checkpoint, block, x = measured
    out = x.untyped_storage().nbytes()                     # the block's output: x's shape
    params = sum(p.untyped_storage().nbytes() for p in block.parameters())
    if wrong == "output counted":                          # every measurement, eager's too
        bad = (_with(runs, out), eager + out, checkpoint + out)
    elif wrong == "x counted":                             # in the backward's saved list
        bad = ({b: dataclasses.replace(r, listed_bytes=r.listed_bytes + out)
                for b, r in runs.items()}, eager, checkpoint)
    elif wrong == "parameters counted":
        bad = (_with(runs, params), eager + params, checkpoint)
    elif wrong == "budget ignored":
        bad = ({0.0: runs[1.0], 1.0: runs[1.0]}, eager, checkpoint)
    else:
        bad = ({b: dataclasses.replace(r, listed_bytes=r.listed_bytes // 2)
                for b, r in runs.items()}, eager, checkpoint)
    _check_measurements(runs, eager, checkpoint)
    with pytest.raises(AssertionError):
        _check_measurements(*bad)


class _Skewed(nn.Module):
    """Compiles to other numbers: its forward (or only its gradient) changes under compile."""

    def __init__(self, gradient_only: bool):
        super().__init__()
        self.lin, self.gradient_only = nn.Linear(32, 32), gradient_only

    def forward(self, x):
        y = self.lin(x).sin()
        if torch.compiler.is_compiling():
            y = y + 0.01 * (y - y.detach()) if self.gradient_only else y * 1.01
        return y


@pytest.mark.parametrize("gradient_only", [False, True], ids=["output", "gradient"])
def test_a_block_that_compiles_to_other_numbers_is_refused(gradient_only):
    torch.manual_seed(0)
    with pytest.raises(AssertionError, match="differs from eager"):
        compiled_saved(_Skewed(gradient_only), _x(), budget=1.0, backend="aot_eager")
    assert torch._functorch.config.activation_memory_budget == 1.0


class _Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return nn.functional.dropout(self.lin(x), 0.5, training=True).sin()


def test_dropout_is_refused_and_budget_zero_redraws_its_mask_in_backward():
    """pytorch/pytorch#190758 in torch 2.13: at budget 0 the backward draws a new mask, so the
    gradient is not the forward's; at budget 1 the mask is saved and the gradient right."""
    torch.manual_seed(0)
    block, x = _Dropout(), _x()
    with pytest.raises(AssertionError, match="random"):
        compiled_saved(block, x, budget=1.0)
    consistent = {}
    for budget in (0.0, 1.0):
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=budget):
            y = torch.compile(block, backend="aot_eager_decomp_partition")(x)
            got, = torch.autograd.grad(y.sum(), x)
        kept = (y != 0).float()                            # sin(0) = 0: the dropped ones
        want, = torch.autograd.grad((block.lin(x) * kept * 2).sin().sum(), x)
        consistent[budget] = torch.allclose(got, want, atol=1e-5)
    torch._dynamo.reset()
    assert consistent == {0.0: False, 1.0: True}


def test_budget_curve_puts_the_solver_and_eagers_two_ends_beside_each_point():
    block, x = _gpt(), _x(1)
    curve = budget_curve(block, x, budgets=(0, 1), rounds=1)
    zero, one = curve.points
    assert (zero.budget, one.budget) == (0.0, 1.0)
    assert zero.compiled.saved_bytes == curve.checkpoint_bytes == zero.fit_bytes == 0
    assert 0 < one.compiled.saved_bytes <= curve.eager_bytes
    assert 0 < one.fit_bytes <= one.compiled.saved_bytes      # fit measured within the budget
    assert sorted(curve.times) == sorted(["eager", "checkpoint", "compiled 0.0", "fit 0.0",
                                          "compiled 1.0", "fit 1.0"])
    assert all(len(t) == 1 for t in curve.times.values())


class _Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        y = self.lin(x)
        torch._dynamo.graph_break()
        return y.sin()


def test_bad_input_gets_a_clear_message_and_leaves_the_config_as_it_was():
    block, x = _gpt(), _x()
    for budget in (1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="budget"):
            compiled_saved(block, x, budget=budget)
    with pytest.raises(ValueError, match="not a torch.compile backend"):
        compiled_saved(block, x, budget=0.5, backend="nope")
    with pytest.raises(TypeError, match="input tensor"):
        compiled_saved(block, [x], budget=0.5)
    with pytest.raises(TypeError, match="module or function"):
        compiled_saved(3, x, budget=0.5)
    with pytest.raises(ValueError, match="requires_grad"):
        compiled_saved(lambda t: t * 2, x.detach(), budget=0.5)
    with pytest.raises(RuntimeError, match="one graph"):
        compiled_saved(_Broken(), x, budget=0.5)
    assert torch._functorch.config.activation_memory_budget == 1.0
    for budgets, rounds in (((0, 0), 1), ((), 1), (0.5, 1), ((0, 1), 0)):
        with pytest.raises(ValueError):
            budget_curve(block, x, budgets=budgets, rounds=rounds)
