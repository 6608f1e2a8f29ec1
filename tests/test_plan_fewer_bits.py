"""companion.plan's chapter-11 levers: 8-bit Adam states and QLoRA's NF4 base. Simulated steps
equal real ones, predictions follow the simulation, the search offers them only when allowed, and a
plan that needs them trains under its budget."""
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from companion import estimate, lowbit
from companion.models import GPT
from companion.plan import (ADAM8BIT_BYTES, DEQUANTIZE_BYTES, EXACT, FEWER_BITS, LOW_PRECISION,
                            Candidate, CostModel, GPTShape, NothingFits, candidates, plan,
                            predict_memory, predict_seconds, simulate, train_command)
from companion.memory import track
from companion.lowbit.nf4 import nf4_row_blocks
from companion.plan.predict import _DEQUANTIZE_CAST_BYTES
from companion.plan.run import _token_batch, run_plan
from companion.plan.training import _quantized_on_host, build, train_step

SMALL = functools.partial(GPT, 96, 32, 48, 4, 4)     # vocab, seq_len, width, depth, heads


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def tables_built():
    """The nearest-level tables of the 8-bit and NF4 maps (a few hundred KiB, built once per
    process and kept) exist before any measured step, as after a run's first step."""
    for code in (lowbit.dynamic_map(True), lowbit.dynamic_map(False), lowbit.NF4):
        lowbit.quantize_blockwise(torch.randn(512), code, 64)


def _real_peak(model_fn, cand: Candidate, steps: int = 2) -> int:
    """Peak of `steps` real steps, built inside the tracked block as `simulate` builds them, the
    data made before it (`run_plan` measures so)."""
    return run_plan(model_fn, cand, cand.micro_batch * cand.accumulation, steps).peak


@pytest.mark.parametrize("cand", [
    Candidate(2, 3, state_bits=8), Candidate(6, 1, 2, "mixed", state_bits=8),
    Candidate(6, lora_rank=4, nf4_base=True),
    Candidate(2, 3, 2, "autocast", lora_rank=4, nf4_base=True)], ids=lambda c: c.describe())
def test_a_simulated_step_needs_what_the_real_one_does(cand):
    assert abs(simulate(SMALL, cand).peak - _real_peak(SMALL, cand)) <= 8


@pytest.mark.parametrize("cand", [
    Candidate(6, state_bits=8), Candidate(2, 3, 2, state_bits=8),
    Candidate(6, 1, 1, "mixed", state_bits=8), Candidate(6, 1, 2, "autocast", state_bits=8),
    Candidate(6, lora_rank=4, nf4_base=True), Candidate(1, 6, 4, lora_rank=4, nf4_base=True),
    Candidate(6, 1, 2, "mixed", lora_rank=4, nf4_base=True),
    Candidate(2, 3, 1, "autocast", lora_rank=4, nf4_base=True)], ids=lambda c: c.describe())
@pytest.mark.parametrize("fused", [False, True])
def test_predictions_follow_the_simulation(cand, fused):
    fn = functools.partial(SMALL, fused_attention=fused)
    predicted = predict_memory(GPTShape.of(fn), cand).peak
    assert abs(predicted - simulate(fn, cand).peak) <= 0.06 * predicted


def _real_step_peak_base_quantized_first(model_fn, cand: Candidate, steps: int = 2) -> int:
    """Peak of `steps` real QLoRA steps whose NF4 base was quantized before the measurement (as
    for a GPU, `simulate(device_type="cuda")`): on the CPU the dense build's peak hides the step's
    otherwise."""
    shape, batch = GPTShape.of(model_fn), cand.micro_batch * cand.accumulation
    data = [_token_batch(batch, shape.seq_len, shape.vocab, i, 0) for i in range(steps)]
    host = _quantized_on_host(model_fn, cand)
    with track("cpu") as tracker:
        setup = build(model_fn, cand, host_model=host)
        del host
        for x, y in data:
            train_step(setup, x, y)
        del setup
    return tracker.peak


@pytest.mark.parametrize("model_fn, cand", [
    (functools.partial(GPT, 80, 8, 224, 2, 4), Candidate(1, lora_rank=4, nf4_base=True)),
    (functools.partial(GPT, 64, 8, 288, 1, 4),
     Candidate(1, 1, 1, "autocast", lora_rank=2, nf4_base=True)),
    (functools.partial(GPT, 72, 12, 160, 2, 4),
     Candidate(1, 2, 1, "mixed", lora_rank=4, nf4_base=True))], ids=["fp32", "autocast", "mixed"])
def test_qlora_dequantization_term_follows_steps_of_wide_layers(model_fn, cand):
    """Wide layers, few tokens: the peak is backward through an NF4 Linear, whose row block's
    buffers (`parts.qlora_dequantize_bytes`, counted from the code) the prediction must get right.
    The term fitted to the whole-weight dequantization (9 bytes per value of the largest weight)
    predicted these steps 67-144% high."""
    shape = GPTShape.of(model_fn)
    predicted = predict_memory(shape, cand, device_type="cuda")
    assert predicted.phase == "QLoRA's dequantization"
    real = _real_step_peak_base_quantized_first(model_fn, cand)
    simulated = simulate(model_fn, cand, device_type="cuda").peak
    assert abs(simulated - real) <= 8
    assert abs(predicted.peak - real) <= 0.03 * real


class _BytesMoved(TorchDispatchMode):
    """Bytes each operator reads and writes: its tensor operands once each (an out= tensor and
    copy_'s destination are only written), its results; views and empty allocations move none."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if func.is_view or name in ("empty", "empty_like", "empty_strided", "new_empty"):
            return out
        operands = tree_flatten((args[1:] if name == "copy_" else args,
                                 {k: v for k, v in kwargs.items() if k != "out"}))[0]
        read = {t.untyped_storage().data_ptr(): t.nbytes for t in operands
                if isinstance(t, torch.Tensor)}
        self.bytes += sum(read.values()) + sum(t.nbytes for t in tree_flatten(out)[0]
                                               if isinstance(t, torch.Tensor))
        return out


def test_the_cost_models_bytes_are_what_the_low_bit_code_moves():
    """ADAM8BIT_BYTES and DEQUANTIZE_BYTES (with its cast) against every operator's reads and
    writes in `lowbit.Adam8bit.step` (AdamW's decay, as the planner builds it) and in
    `lowbit.nf4_row_blocks`, per value of a 2^22-value tensor (the map tables' few KiB
    negligible): a change to either that moves more or fewer bytes fails here."""
    n = 2**22
    p = torch.nn.Parameter(torch.randn(n))
    opt = lowbit.Adam8bit([p], weight_decay=0.01, decoupled_weight_decay=True)
    p.grad = torch.randn(n)
    opt.step()                                     # the 8-bit moments exist
    with _BytesMoved() as moved:
        opt.step()
    assert abs(moved.bytes / n - ADAM8BIT_BYTES) <= 0.03 * ADAM8BIT_BYTES
    for precision, base, compute in [("fp32", torch.float32, torch.float32),
                                     ("autocast", torch.float32, torch.bfloat16),
                                     ("mixed", torch.bfloat16, torch.bfloat16)]:
        q = lowbit.quantize_nf4(torch.randn(2048, n // 2048, dtype=base), double_quant=True)
        with _BytesMoved() as moved:
            for _ in nf4_row_blocks(q, compute):
                pass
        expected = DEQUANTIZE_BYTES + _DEQUANTIZE_CAST_BYTES[precision]
        assert abs(moved.bytes / n - expected) <= 0.05 * expected, precision


def test_each_lever_saves_the_estimators_bytes():
    shape = GPTShape.of(SMALL)
    plain, eight = (predict_memory(shape, Candidate(6, state_bits=b)) for b in (32, 8))
    small = shape.n_params_small
    assert plain.optimizer_state - eight.optimizer_state == 8 * shape.n_params - (
        estimate.model_states(shape.n_params - small, state_bits=8).optimizer + 8 * small)
    lora, qlora = (predict_memory(shape, Candidate(6, lora_rank=4, nf4_base=q)) for q in (0, 1))
    linear = shape.lora_linear_weights()
    assert lora.parameters - qlora.parameters == shape.depth * sum(
        4 * n - estimate.nf4_bytes(n) for n in linear)


def test_quantizing_on_the_host_keeps_the_dense_base_off_the_gpu():
    """A 1.4B GPT's QLoRA step for a GPU: the bf16 base (2.8 GB, more than the whole step) is
    never on the device, and the simulation lands within 5% of the prediction."""
    fn = functools.partial(GPT, 50257, 1024, 2048, 24, 16, fused_attention=True)
    shape = GPTShape.of(fn)
    cand = Candidate(1, 4, 24, "mixed", lora_rank=16, nf4_base=True)   # few activations
    simulated = simulate(fn, cand, device_type="cuda").peak
    predicted = predict_memory(shape, cand, device_type="cuda").peak
    assert abs(predicted - simulated) <= 0.05 * simulated
    on_cpu = predict_memory(shape, cand, device_type="cpu")   # host = device: the build's peak
    assert on_cpu.phase.startswith("build") and on_cpu.peak > 2 * shape.n_params
    built_here = simulate(fn, cand).peak                      # the dense base, then its codes
    assert abs(on_cpu.peak - built_here) <= 0.05 * built_here
    assert simulated < 2 * shape.n_params < built_here         # the dense bf16 base alone


def test_the_search_offers_them_only_when_allowed_and_never_with_offload():
    shape = GPTShape.of(SMALL)
    assert not any(c.state_bits == 8 or c.nf4_base for c in candidates(
        shape, 12, allow=EXACT + LOW_PRECISION + ("lora",)))
    found = candidates(shape, 12, allow=EXACT + LOW_PRECISION + FEWER_BITS, lora_rank=2)
    assert any(c.state_bits == 8 for c in found) and any(c.nf4_base for c in found)
    assert all(c.lora_rank == 2 and not c.offload for c in found if c.nf4_base)
    assert not any(c.lora_rank and not c.nf4_base for c in found)     # "lora" not allowed
    assert not any(c.state_bits == 8 and (c.offload or c.lora_rank) for c in found)
    with pytest.raises(ValueError, match="lora_rank"):
        Candidate(4, nf4_base=True)
    with pytest.raises(ValueError, match="32 or 8"):
        Candidate(4, state_bits=4)
    with pytest.raises(ValueError, match="without offload"):
        Candidate(4, offload=True, state_bits=8)


def test_what_they_cost_in_time():
    shape, gpu = GPTShape.of(SMALL), CostModel.for_device("cuda")
    t = lambda c: predict_seconds(shape, c, gpu)
    assert t(Candidate(6, state_bits=8))["optimizer"] > t(Candidate(6))["optimizer"]
    q, lora = t(Candidate(6, lora_rank=4, nf4_base=True)), t(Candidate(6, lora_rank=4))
    assert q["dequantize"] > 0 == lora["dequantize"] and q["compute"] == lora["compute"]
    assert t(Candidate(6, 1, 2, lora_rank=4, nf4_base=True))["dequantize"] > q["dequantize"]


def test_8_bit_states_are_chosen_where_only_they_fit_and_train_under_the_budget():
    shape = GPTShape.of(SMALL)                     # no host memory to offload to
    smallest = {bits: min(predict_memory(shape, c).peak for c in candidates(
        shape, 12, allow=EXACT + ("adam8bit",)) if not c.offload and c.state_bits == bits)
        for bits in (32, 8)}
    assert smallest[8] < smallest[32]
    budget = (smallest[8] + smallest[32]) // 2
    with pytest.raises(NothingFits, match="allow adam8bit"):
        plan(SMALL, 12, budget=budget, device="cpu", host_budget=0)
    p = plan(SMALL, 12, budget=budget, device="cpu", allow=EXACT + ("adam8bit",), host_budget=0,
             simulate_plain=False)
    assert p.chosen.state_bits == 8 and "8-bit Adam states" in str(p)
    report = p.run(3)                              # raises OutOfMemoryError if it does not fit
    plain = run_plan(SMALL, Candidate(12), 12, 3)
    assert report.peak <= p.budget
    torch.testing.assert_close(report.losses, plain.losses, rtol=2e-3, atol=0)
    assert "8-bit Adam states" in train_command(p)     # the launcher lacks it


def test_nothing_fits_names_the_host_memory_that_would_do():
    with pytest.raises(NothingFits, match=r"give the host .* \(host_budget\)"):
        plan(SMALL, 12, budget="1200 KiB", device="cpu", host_budget="1 KiB")


def test_a_simulated_qlora_step_runs_one_row_block_and_peaks_as_the_whole_loop(monkeypatch):
    # under fake tensors nf4_row_blocks runs only its widest block (each block fills the same
    # buffers): the simulated peak must be the byte-exact peak of running every block
    from companion.lowbit import nf4
    from companion.models import Llama
    model_fn = functools.partial(Llama, 128, 32, 96, 2, 4, kv_heads=2, intermediate=160)
    cand = Candidate(2, precision="mixed", lora_rank=4, nf4_base=True)
    monkeypatch.setattr(nf4, "BLOCK_VALUES", 2048)     # several row blocks per Linear
    calls = []
    ranges = nf4._dequantize_range
    monkeypatch.setattr(nf4, "_dequantize_range",
                        lambda *a, **k: calls.append(a[3:5]) or ranges(*a, **k))
    shortcut = simulate(model_fn, cand).peak
    one_each = len(calls)

    class NotFake:                                     # isinstance(..., FakeTensor) never holds
        pass

    monkeypatch.setattr(nf4, "FakeTensor", NotFake)
    calls.clear()
    every_block = simulate(model_fn, cand).peak
    assert shortcut == every_block
    assert len(calls) >= 3 * one_each                  # the whole loop ran several blocks each
