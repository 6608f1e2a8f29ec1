"""How the trainers of the published runs differ from the course's step, as plan options
(issue 52): every block checkpointed, the last too (`Candidate.checkpoint_last`); LoRA on some of a
block's Linears (`lora_targets`, `--lora-targets`); bitsandbytes < 0.43.2's 4-bit Linears, which
keep their inputs until the graph is freed (`nf4_keeps_inputs`). Each: the real step on this CPU
needs what the simulated one does, the formulas follow the simulation, and bad values are refused.
"""
import dataclasses
import functools
import json
import pathlib
import tempfile

import pytest
import torch

from companion import lowbit
from companion.__main__ import main
from companion.checkpointing import checkpoint_sequential
from companion.memory import track
from companion.models import GPT
from companion.plan import (Candidate, GPTShape, candidates, load_config, plan, predict_memory,
                            predict_seconds, run_plan, simulate)
from companion.plan.costmodel import CostModel
from companion.plan.training import build

SMALL = functools.partial(GPT, 96, 32, 48, 4, 4)          # vocab, seq_len, width, depth, heads
FUSED = functools.partial(GPT, 2048, 64, 64, 4, 4, fused_attention=True)


@pytest.fixture(scope="module")
def llama():
    """Llama 2 7B's shape at 128 tokens: its step simulated for CUDA in seconds."""
    fn = load_config("llama-2-7b").model_fn(128)
    return fn, GPTShape.of(fn)


@pytest.fixture(scope="module", autouse=True)
def tables_built():
    """The nearest-level tables of the NF4 and 8-bit maps (built once per process for each
    map and dtype, and kept: 1.8 MiB for a bf16 base) exist before any measured step, as after
    a run's first step: one QLoRA model of each base dtype is built first."""
    for precision in ("fp32", "mixed"):
        build(SMALL, Candidate(4, precision=precision, lora_rank=3, nf4_base=True))


def _real_peak(model_fn, cand: Candidate) -> int:
    return run_plan(model_fn, cand, cand.micro_batch * cand.accumulation, 2).peak


# --- every block checkpointed, the last too ------------------------------------------------------

def test_checkpointing_the_last_segment_too_keeps_its_input_only_and_changes_no_gradient():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                                  torch.nn.Linear(128, 32)) for _ in range(4)]
    x = torch.randn(64, 32, requires_grad=True)
    peaks, grads = {}, {}
    for last in (False, True):
        with track("cpu") as tracker:
            y = checkpoint_sequential(layers, 2, x, use_reentrant=False, last=last)
            saved = tracker.current
            y.sum().backward()
        peaks[last], grads[last] = saved, x.grad.clone()
        x.grad = None
    assert torch.equal(grads[False], grads[True])
    # the last segment's two layers kept their (64, 128) GELU input and output and the middle
    # (64, 32) input: with last=True only the segment's input (already alive) remains
    assert peaks[False] - peaks[True] >= 2 * 2 * 64 * 128 * 4


@pytest.mark.parametrize("cand", [
    Candidate(4, segments=4, checkpoint_last=True),
    Candidate(2, 2, segments=2, checkpoint_last=True, precision="mixed"),
    Candidate(4, segments=2, checkpoint_last=True, chunked_loss=4),
], ids=lambda c: c.describe())
def test_the_last_segment_checkpointed_is_simulated_as_it_runs(cand):
    assert abs(simulate(SMALL, cand).peak - _real_peak(SMALL, cand)) <= 8


@pytest.mark.parametrize("cand, tolerance", [
    (Candidate(8, segments=4, checkpoint_last=True), 0.01),
    (Candidate(8, segments=2, checkpoint_last=True, precision="autocast"), 0.01),
    (Candidate(4, 2, segments=4, checkpoint_last=True, chunked_loss=4), 0.01),
    (Candidate(8, segments=4, checkpoint_last=True, lora_rank=4), 0.015),
])
def test_checkpoint_last_predicts_the_simulated_peak(cand, tolerance):
    predicted = predict_memory(GPTShape.of(FUSED), cand).peak
    assert abs(predicted / simulate(FUSED, cand).peak - 1) <= tolerance
    plain = dataclasses.replace(cand, checkpoint_last=False)
    assert predicted < predict_memory(GPTShape.of(FUSED), plain).peak


def test_checkpoint_last_on_a_llama_for_cuda(llama):
    fn, shape = llama
    for last in (False, True):
        cand = Candidate(2, segments=32, precision="mixed", lora_rank=8, chunked_loss=8,
                         checkpoint_last=last)
        predicted = predict_memory(shape, cand, device_type="cuda").peak
        simulated = simulate(fn, cand, device_type="cuda", shape=shape).peak
        assert abs(predicted / simulated - 1) < 0.005, (last, predicted, simulated)


def test_checkpoint_last_recomputes_every_block():
    shape, cost = GPTShape.of(FUSED), CostModel.for_device("cpu")
    cand = Candidate(8, segments=4)
    assert cand.recomputed_blocks(4) == 3 and Candidate(8).recomputed_blocks(4) == 0
    assert dataclasses.replace(cand, checkpoint_last=True).recomputed_blocks(4) == 4
    once = predict_seconds(shape, cand, cost)["recompute"]
    every = predict_seconds(shape, dataclasses.replace(cand, checkpoint_last=True), cost)
    assert every["recompute"] == pytest.approx(once * 4 / 3)


@pytest.mark.parametrize("fields", [dict(checkpoint_last=True),
                                    dict(segments=2, checkpoint_last=True,
                                         activation_offload=True)])
def test_checkpoint_last_needs_segments_and_no_activation_offload(fields):
    with pytest.raises(ValueError, match="checkpoint_last"):
        Candidate(4, **fields)


# --- LoRA on some Linears --------------------------------------------------------------------------

def test_lora_targets_adapt_the_named_linears_and_qlora_quantizes_them_all():
    shape = GPTShape.of(SMALL)
    for targets in [("qkv",), ("proj", "out"), ()]:
        setup = build(SMALL, Candidate(4, lora_rank=3, lora_targets=targets))
        trained = sum(p.numel() for p in setup.model.parameters() if p.requires_grad)
        assert trained == shape.lora_params(3, targets)
        qlora = build(SMALL, Candidate(4, precision="mixed", lora_rank=3, nf4_base=True,
                                       lora_targets=targets)).model
        nf4 = [m for m in qlora.modules() if isinstance(m, lowbit.QLoRALinear)]
        assert len(nf4) == 4 * 4                       # every Linear of the 4 blocks, in NF4
        assert sum(m.A is not None for m in nf4) == 4 * (len(targets) or 4)


@pytest.mark.parametrize("cand", [
    Candidate(4, lora_rank=3, lora_targets=("qkv",)),
    Candidate(2, 2, precision="mixed", lora_rank=3, lora_targets=("proj", "fc")),
    Candidate(4, precision="mixed", lora_rank=3, nf4_base=True, lora_targets=("out",)),
], ids=lambda c: c.describe())
def test_lora_targets_are_simulated_as_they_run(cand):
    assert abs(simulate(SMALL, cand).peak - _real_peak(SMALL, cand)) <= 8


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("o_proj",), ("down_proj",),
                                     ("gate_proj", "up_proj")])
@pytest.mark.parametrize("nf4", [False, True])
def test_lora_targets_predict_the_simulated_llama_step(llama, targets, nf4):
    fn, shape = llama
    cand = Candidate(2, precision="mixed", lora_rank=32, nf4_base=nf4, lora_targets=targets)
    predicted = predict_memory(shape, cand, device_type="cuda").peak
    simulated = simulate(fn, cand, device_type="cuda", shape=shape).peak
    # the first block's ops before its first adapter save nothing (no input needs a gradient
    # yet): not counted, at most one block's share
    assert abs(predicted / simulated - 1) < 0.015, (predicted, simulated)
    everything = predict_memory(shape, dataclasses.replace(cand, lora_targets=()),
                                device_type="cuda").peak
    assert predicted < everything


@pytest.mark.parametrize("cand", [
    Candidate(8, lora_rank=4, lora_targets=("qkv",)),
    Candidate(8, precision="mixed", lora_rank=4, lora_targets=("qkv", "out")),
    Candidate(8, precision="mixed", lora_rank=4, nf4_base=True, lora_targets=("qkv",)),
    Candidate(8, precision="mixed", lora_rank=4, nf4_base=True, lora_targets=("qkv", "fc")),
], ids=lambda c: c.describe())
def test_lora_targets_predict_the_simulated_gpt_step(cand):
    predicted = predict_memory(GPTShape.of(FUSED), cand).peak
    assert abs(predicted / simulate(FUSED, cand).peak - 1) < 0.02


def test_an_own_models_lora_targets_are_traced_and_simulated():
    from companion.plan.known import Traced
    from examples.models import llama as own

    traced = Traced(own)
    found = traced.candidates(4, world_size=1, allow=("lora",), lora_rank=4,
                              lora_targets=["wq", "wv", "wq"])
    adapted = [c for c in found if c.lora_rank]
    assert adapted and all(c.lora_targets == ("wq", "wv") for c in adapted)
    every = dataclasses.replace(adapted[0], lora_targets=())
    some, whole = (traced.simulate(c, world_size=1, device_type="cpu").peak
                   for c in (adapted[0], every))
    assert some < whole            # wo, gate, up and down's inputs are not saved for adapters
    seconds = [traced.predict(c, world_size=1, device_type="cpu",
                              cost=CostModel.for_device("cpu"))[1] for c in (adapted[0], every)]
    assert seconds[0]["total"] != seconds[1]["total"]
    with pytest.raises(ValueError, match="no nn.Linear named 'q_proj'"):
        traced.candidates(4, world_size=1, allow=("lora",), lora_rank=4, lora_targets=("q_proj",))


def test_lora_targets_are_searched_as_given_and_refused_when_unknown():
    shape = GPTShape.of(SMALL)
    found = candidates(shape, 4, allow=("lora", "qlora", "mixed"), lora_rank=2,
                       lora_targets=("qkv",))
    assert {c.lora_targets for c in found if c.lora_rank} == {("qkv",)}
    assert all(c.lora_targets == () for c in found if not c.lora_rank)
    with pytest.raises(ValueError, match="qkv, proj, fc, out"):
        candidates(shape, 4, allow=("lora",), lora_targets=("q_proj",))
    with pytest.raises(ValueError, match="lora_rank"):
        Candidate(4, lora_targets=("qkv",))
    with pytest.raises(ValueError, match="tuple of Linear names"):
        Candidate(4, lora_rank=2, lora_targets="qkv")
    for bad in ("qkv", None, ("qkv", "")):
        with pytest.raises(ValueError, match="tuple of Linear names"):
            candidates(shape, 4, allow=("lora",), lora_targets=bad)
    assert {c.lora_targets for c in candidates(shape, 4, allow=("lora",), lora_targets=[
        "qkv", "qkv"]) if c.lora_rank} == {("qkv",)}
    with pytest.raises(ValueError, match="twice"):
        Candidate(4, lora_rank=2, lora_targets=("qkv", "qkv"))
    with pytest.raises(ValueError, match="allow lora or qlora"):
        plan(SMALL, 4, budget="64 MiB", device="cpu", lora_targets=("qkv",))


def test_the_command_line_plans_lora_on_the_named_linears(capsys):
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
              "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100,
              "max_position_embeddings": 32}
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "config.json"
        path.write_text(json.dumps(config))
        rc = main(["plan", "--model", str(path), "--gpu", "RTX 4090", "--batch", "4",
                   "--budget", "600MiB", "--allow", "lora", "--lora-targets", "q_proj,v_proj",
                   "--simulate", "0", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    plans = json.loads(out.out)["plans"]
    assert any("LoRA r=8 on q_proj, v_proj" in p["plan"] for p in plans), plans
    rc = main(["plan", "--model", "llama-3-8b", "--allow", "lora",
               "--lora-targets", "q_proj,wq", "--simulate", "0"])
    assert rc == 2 and "['wq'] are not Linears" in capsys.readouterr().err


# --- bitsandbytes < 0.43.2's kept inputs -------------------------------------------------------------

def test_a_kept_input_outlives_backward_until_the_graph_is_freed():
    layer = lowbit.QLoRALinear.from_linear(torch.nn.Linear(256, 256), rank=4)
    x = torch.randn(512, 256, requires_grad=True)
    for keep in (False, True):
        layer.keeps_input = keep
        with track("cpu") as tracker:
            h = x * 2                                      # a tensor the layer alone reads
            loss = layer(h).sum()
            del h
            loss.backward()
            after = tracker.current
            del loss                                       # the graph freed
            freed = tracker.current
        assert (after - freed >= 512 * 256 * 4) == keep


@pytest.mark.parametrize("cand", [
    Candidate(4, precision="mixed", lora_rank=3, nf4_base=True, nf4_keeps_inputs=True),
    Candidate(2, 2, precision="mixed", lora_rank=3, nf4_base=True, nf4_keeps_inputs=True,
              lora_targets=("qkv",)),
], ids=lambda c: c.describe())
def test_kept_inputs_are_simulated_as_they_run(cand):
    assert abs(simulate(SMALL, cand).peak - _real_peak(SMALL, cand)) <= 8


@pytest.mark.parametrize("k, targets", [(1, ()), (4, ()), (1, ("q_proj", "v_proj")),
                                        (4, ("q_proj", "v_proj"))])
def test_kept_inputs_predict_the_simulated_llama_step(llama, k, targets):
    fn, shape = llama
    cand = Candidate(2, k, precision="mixed", lora_rank=32, nf4_base=True, lora_targets=targets,
                     nf4_keeps_inputs=True)
    predicted = predict_memory(shape, cand, device_type="cuda")
    simulated = simulate(fn, cand, device_type="cuda", shape=shape).peak
    assert abs(predicted.peak / simulated - 1) < 0.01, (predicted, simulated)
    if k > 1:          # the micro-batch before's inputs: 2 B x tokens x (3·C + I) x depth
        without = predict_memory(shape, dataclasses.replace(cand, nf4_keeps_inputs=False),
                                 device_type="cuda").peak
        every = 2 * 2 * 128 * (3 * 4096 + 11008) * 32
        assert predicted.phase == "forward, the last output held"
        assert predicted.peak - without >= 0.9 * every


@pytest.mark.parametrize("fields", [dict(lora_rank=4, nf4_keeps_inputs=True),
                                    dict(lora_rank=4, nf4_base=True, segments=2,
                                         nf4_keeps_inputs=True),
                                    dict(lora_rank=4, nf4_base=True, activation_offload=True,
                                         nf4_keeps_inputs=True),
                                    dict(lora_rank=4, nf4_base=True, nf4_keeps_inputs="yes"),
                                    dict(segments=2, checkpoint_last=1)])
def test_kept_inputs_are_qloras_and_planned_without_checkpointing(fields):
    with pytest.raises(ValueError, match="nf4_keeps_inputs|checkpoint_last"):
        Candidate(4, **fields)


@pytest.mark.parametrize("cand", [
    Candidate(8, precision="mixed", lora_rank=4, nf4_base=True, nf4_keeps_inputs=True),
    Candidate(4, 2, precision="mixed", lora_rank=4, nf4_base=True, nf4_keeps_inputs=True,
              lora_targets=("qkv", "out")),
    Candidate(4, 2, lora_rank=4, nf4_base=True, nf4_keeps_inputs=True),
], ids=lambda c: c.describe())
def test_kept_inputs_predict_the_simulated_gpt_step(cand):
    predicted = predict_memory(GPTShape.of(FUSED), cand).peak
    assert abs(predicted / simulate(FUSED, cand).peak - 1) < 0.015


def test_the_loop_holds_the_last_output_through_the_step_and_the_next_forward():
    """train_step as litgpt's loop: Setup.held keeps the last forward's output, graph and kept
    inputs with it, through the optimizer step, until the next forward returns."""
    cand = Candidate(4, precision="mixed", lora_rank=3, nf4_base=True, nf4_keeps_inputs=True)
    setup = build(SMALL, cand)
    x = torch.randint(96, (4, 32))
    from companion.plan.training import train_step
    seen = []
    step = setup.optimizer.step

    def watched():
        seen.append(len(setup.held))
        step()
    setup.optimizer.step = watched
    train_step(setup, x, x)
    first = setup.held[0]
    train_step(setup, x, x)
    assert seen == [1, 1] and setup.held[0] is not first and first.grad_fn is not None


def test_a_rank_0_qlora_linear_is_the_frozen_nf4_linear_alone():
    torch.manual_seed(0)
    dense = torch.nn.Linear(128, 64)
    frozen = lowbit.QLoRALinear.from_linear(dense, rank=0)
    assert frozen.A is None and not list(frozen.parameters())
    x = torch.randn(8, 128)
    merged = frozen.merge()
    assert torch.equal(merged(x), frozen(x)) or torch.allclose(merged(x), frozen(x), atol=1e-6)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    with pytest.raises(ValueError, match="adapts only quantized Linears"):
        lowbit.apply_qlora(model, 2, targets=["0"], quantize=["1"])


def test_time_terms_follow_the_targets_and_the_last_segment():
    shape, cost = GPTShape.of(FUSED), CostModel.for_device("cpu")
    qlora = Candidate(8, segments=4, precision="mixed", lora_rank=4, nf4_base=True)
    once = predict_seconds(shape, qlora, cost)
    every = predict_seconds(shape, dataclasses.replace(qlora, checkpoint_last=True), cost)
    L = shape.depth                         # every base weight dequantized once more per block
    assert every["dequantize"] / once["dequantize"] == pytest.approx((2 * L + L) / (2 * L + 3))
    some = predict_seconds(shape, dataclasses.replace(qlora, lora_targets=("qkv",)), cost)
    assert some["adapters"] < once["adapters"] and some["dequantize"] == once["dequantize"]
