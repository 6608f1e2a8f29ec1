"""companion.plan.parallel: memory per GPU by line against hand formulas, against a measured
course Llama block, against Megatron-LM's theoretical memory and the Llama 3 paper's layouts;
step time by part; the command line; bad input."""
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from companion.models.llama import LlamaBlock, Rotary
from companion.plan.configs import load_config
from companion.plan.parallel import (Layout, Shape, check_layout, estimate, layer_activation_bytes,
                                     memory, search, step_time)
from companion.plan.parallel_published import (LLAMA3_405B, TORCHTITAN_405B, TORCHTITAN_70B,
                                               megatron_bytes, published, torchtitan_error)
from companion.plan.parallel_report import plan_parallel

pytestmark = pytest.mark.usefixtures("one_thread")

L70 = Shape.from_config(load_config("llama-3-70b"))


def _lines(shape, layout, seq):
    stage, lines = memory(shape, layout, seq)
    return stage, {x.name: x.value for x in lines}


def test_memory_lines_of_llama_3_70b_by_hand():
    """TP 8, PP 4, DP 2, ZeRO-1, 256 micro-batches of one 8,192-token sequence, no checkpointing.
    A layer's matmuls 2·8192² + 2·8192·1024 + 3·8192·28672 = 855,638,016 weights, 106,954,752
    a rank, plus its two whole RMSNorms (16,384): 106,971,136; 20 layers and the embedding's
    128,256·8192/8 = 131,334,144 on the first stage: 2,270,756,864 parameters."""
    stage, got = _lines(L70, Layout(8, 4, 1, 2, 1, 1, 256, "none"), 8192)
    params = 20 * 106_971_136 + 131_334_144
    assert stage == "first" and params == 2_270_756_864
    assert got["weights (bf16)"] == 2 * params
    assert got["gradients (fp32 main_grad)"] == 4 * params
    assert got["optimizer (fp32 master, Adam m and v)"] == 12 * params // 2
    # a layer: 2·8192·(4·8192 + 2·8192 + 2·1024 + 4·28672) + 8·8192 + 4·64·8192, over t = 8
    per_layer = (2 * 8192 * 165_888 + 65_536 + 2_097_152) // 8
    assert per_layer == 340_008_960 == layer_activation_bytes(L70, 1, 8192, t=8)
    assert got["activations"] == 4 * 20 * per_layer             # p = 4 micro-batches in flight
    assert got["token ids (int64)"] == 4 * 8 * 8192


def test_checkpointing_context_and_the_last_stage():
    b, s = 2, 4096
    none = layer_activation_bytes(L70, b, s, t=4, c=2)
    assert layer_activation_bytes(L70, b, s, t=4, c=2, checkpointing="selective") == \
        none - 2 * b * s * 2 * 28672 // 8                     # silu and the product, over t·c
    assert layer_activation_bytes(L70, b, s, t=4, c=2, checkpointing="full") == 2 * b * s * 8192 // 8
    assert layer_activation_bytes(L70, b, s, t=1, c=1) // 8 == none   # t·c = 8 divides every term
    stage, got = _lines(L70, Layout(8, 4, 1, 2, 1, 1, 2, "none"), 8192)      # m = 2 < p = 4
    assert got["activations"] == 2 * 20 * 340_008_960
    stage, only = _lines(L70, Layout(8, 1, 1, 8, 1, 1, 64, "full"), 8192)   # one stage
    assert stage == "only" and only["loss's fp32 logits"] == 4 * 8192 * 128256 // 8
    assert only["token ids (int64)"] == 8 * 8192 and only["one layer recomputed"] == 340_008_960
    assert only["weights (bf16)"] == 2 * (80 * 106_971_136 + 2 * 131_334_144 + 8192)
    interleaved = _lines(L70, Layout(8, 4, 1, 2, 1, 1, 256, "none", v=2), 8192)[1]
    assert interleaved["activations"] == int(4 * (1 + 3 / 8) * 20 * 340_008_960)


def test_the_llama_layer_count_against_a_measured_course_llama_block():
    """The course's LlamaBlock in bf16 on this CPU, every tensor autograd saves recorded by
    `saved_tensors_hooks` (storages counted once, weights and the rotary tables left out): the
    count equals `layer_activation_bytes` to the byte but for the RMSNorms, which the CPU runs as
    torch's composite (an fp32 copy of the input and x·rstd in fp32, 8·N·C bytes, where CUDA's
    fused kernel keeps the bf16 input, 2·N·C): 2 x 6·N·C more, measured."""
    C, H, KV, I, B, T = 64, 8, 2, 176, 2, 48
    torch.manual_seed(0)
    rotary = Rotary(C // H, T, dtype=torch.bfloat16)
    block = LlamaBlock(C, H, kv_heads=KV, intermediate=I, rotary=rotary, dtype=torch.bfloat16)
    owned = {t.untyped_storage().data_ptr()
             for t in [*block.parameters(), *block.buffers(), *rotary.buffers()]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in owned:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x = torch.randn(B, T, C, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x).sum().backward()
    shape = Shape(1, C, H, KV, I, 100)
    N = B * T
    assert sum(saved.values()) == layer_activation_bytes(shape, B, T) + 2 * 6 * N * C


def test_weights_and_optimizer_agree_with_megatron_and_activations_differ_by_named_terms():
    """Megatron-LM's theoretical memory (`megatron_bytes`, see parallel_published): the model
    states agree within 0.02% (Megatron divides the RMSNorm weights over t, here they stay
    whole). A Llama layer keeps less than its sbh(18 + 4·ffn/h): no dropout masks (2·sbh: one
    byte a value after attention and after the MLP) and k and v kv_heads wide, not h (4·sb·(h -
    K)); rstd and the log-sum-exp (8·sb + 4·b·a·s) it leaves out. With those named, equal to the
    byte; for Llama 3 70B the activations are 0.83 of Megatron's."""
    layout = Layout(8, 4, 1, 2, 1, 1, 256, "selective")
    _, mine = _lines(L70, layout, 8192)
    theirs = megatron_bytes(L70, layout, 8192)
    states = sum(mine[k] for k in mine if k.split(" ")[0] in ("weights", "gradients", "optimizer"))
    assert states == pytest.approx(theirs["weights and optimizer"], rel=2e-4)
    b, s, C, K, I, a, t = 1, 8192, 8192, 1024, 28672, 64, 8
    N = b * s
    ours = layer_activation_bytes(L70, b, s, t=t, checkpointing="selective") * t
    assert ours - 8 * N - 4 * b * a * s + 2 * N * C + 4 * N * (C - K) == N * C * 18 + 4 * N * I
    ratio = mine["activations"] / (theirs["activations"] - (8 * s + s * C) * 4 / t)
    assert ratio == pytest.approx(0.828, abs=0.005)


@pytest.mark.parametrize("row", published(), ids=lambda r: f"DP{r.d}")
def test_the_llama_3_405b_layouts_of_the_paper_fit_80_gb(row):
    """arXiv:2407.21783 Table 4 (see `parallel_published`): TP 8, CP 1, PP 16 and DP 64 or 128
    at 8,192 tokens, 16M a batch, trained on 80 GB H100s. With selective recomputation the first
    stage needs 75.6 GB (DP 64) and 75.3 GB (DP 128): fits, 5.5% under; without any, 103.6 GB:
    it would not; Megatron's GPT count (k and v as wide as q, dropout masks) says 88 GB, over."""
    m = row.batch_tokens // row.seq_len // row.d
    fit = estimate(LLAMA3_405B, Layout(row.t, row.p, row.c, row.d, 1, 1, m, "selective"),
                   row.seq_len)
    assert fit.total_bytes <= row.card_bytes
    assert 0.9 * row.card_bytes < fit.total_bytes                # and not by a wide margin
    plain = estimate(LLAMA3_405B, Layout(row.t, row.p, row.c, row.d, 1, 1, m, "none"),
                     row.seq_len)
    assert plain.total_bytes > row.card_bytes
    theirs = megatron_bytes(LLAMA3_405B, fit.layout, row.seq_len)
    assert sum(theirs.values()) > row.card_bytes


def test_step_time_parts():
    one = {x.name: x.value for x in step_time(L70, Layout(1, 16, 4, 1, 1, 1, 512, "selective"),
                                              8192)}
    assert one["tensor parallel"] == 0
    tp = {x.name: x.value for x in step_time(L70, Layout(8, 4, 1, 2, 1, 1, 256, "none"), 8192)}
    assert tp["tensor parallel"] > 0 and tp["context parallel (exposed)"] == 0
    assert tp["pipeline bubble"] == pytest.approx(3 / 256 * (tp["compute"] + tp["tensor parallel"]))
    full = {x.name: x.value for x in step_time(L70, Layout(8, 4, 1, 2, 1, 1, 256, "full"), 8192)}
    assert full["compute"] > tp["compute"] and full["tensor parallel"] > tp["tensor parallel"]
    inside = step_time(L70, Layout(8, 1, 1, 1, 0, 1, 16, "full"), 8192)   # 8 GPUs: no network
    assert all("network" not in x.formula for x in inside)


def test_search_finds_fitting_layouts_fastest_first():
    found = search(L70, gpus=64, gpus_per_node=8, seq_len=8192, batch=512)
    assert found and all(e.fit(load_usable()).fits for e in found)
    names = {o.name for o in found[0].fit(load_usable()).lines}
    assert {"CUDA context", "cuBLAS workspace", "NCCL buffers"} <= names
    assert found[0].fit(load_usable()).total > found[0].total_bytes
    assert not any(e.layout.zero == 3 and e.layout.p > 1 for e in found)   # priced, not searched
    assert any(e.layout.zero == 3 for e in found)
    assert [e.seconds for e in found] == sorted(e.seconds for e in found)
    assert any(e.layout.t > 1 and e.layout.p > 1 for e in found[:5])


def load_usable():
    from companion.cost.gpus import gpu
    return gpu("H100 SXM").usable_bytes


def _plan(*extra):
    return subprocess.run([sys.executable, "-m", "companion", "plan", "--model", "llama-3-70b",
                           "--gpu", "H100 SXM", "--gpus", "64", *extra],
                          capture_output=True, text=True, timeout=300)


def test_the_command_line_plans_70b_on_64_gpus():
    args = ("--gpus-per-node", "8", "--seq-len", "8192", "--batch", "4M-tokens")
    text = _plan(*args)
    assert text.returncode == 0, text.stderr
    assert "by formula" in text.stdout and "pipeline parallel" in text.stdout
    assert "NCCL buffers" in text.stdout and "CUDA context" in text.stdout
    data = json.loads(_plan(*args, "--json").stdout)
    levers = [lever for plan in data["plans"] for lever in plan["levers"]]
    assert any(x.startswith("tensor parallel ") for x in levers)
    assert any(x.startswith("pipeline parallel ") for x in levers)
    chosen = data["chosen"]
    assert chosen["gpu_bytes"] <= data["budget"] and chosen["checked"] == "formula"
    assert sum(x["bytes"] for x in chosen["memory_lines"]) == chosen["gpu_bytes"]
    assert data["batch_sequences"] == 512 and data["n_params"] == 70_553_706_496


@pytest.mark.parametrize("layout, message", [
    (Layout(8, 2, 1, 4), "inside a node of 4"),
    (Layout(4, 3, 1, 1), "not the 64 GPUs"),
    (Layout(2, 32, 1, 1), "divide the 80 layers"),
    (Layout(1.5, 1, 1, 1), "whole numbers"),
    (Layout(4, 16, 1, 1, zero=2), "ZeRO stage 0, 1"),
    (Layout(4, 16, 1, 1, checkpointing="some"), "checkpointing"),
])
def test_bad_layouts_are_named(layout, message):
    with pytest.raises(ValueError, match=message):
        check_layout(L70, layout, 8192, gpus=64, gpus_per_node=4)
    shape = dataclasses.replace(L70, heads=12, kv_heads=12)
    with pytest.raises(ValueError, match="divide the 12 heads"):
        check_layout(shape, Layout(8, 8, 1, 1), 8192, gpus=64, gpus_per_node=8)


def test_bad_input_on_the_command_line_and_in_python():
    with pytest.raises(ValueError, match="not whole nodes"):
        plan_parallel("llama-3-70b", gpus=60, gpus_per_node=8)
    with pytest.raises(ValueError, match="untied Llama"):
        plan_parallel("gpt2-xl", gpus=8, gpus_per_node=8)
    with pytest.raises(ValueError, match="at most 8192"):
        plan_parallel("llama-3-70b", gpus=8, gpus_per_node=8, seq_len=16384)
    bad = _plan("--gpus-per-node", "8", "--allow", "zero")
    assert bad.returncode == 2 and "--allow" in bad.stderr
    bad = _plan("--gpus-per-node", "0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_without_gpus_per_node_a_model_that_fits_no_other_plan_gets_the_parallel_layouts():
    """Llama 3.1 405B on 16 GPUs with no host memory: no plan of data parallelism, ZeRO and
    checkpointing fits, so the command says so and prices the parallel layouts (8 to a node);
    none fits 16 GPUs either, and it says that too (exit 1)."""
    run = [sys.executable, "-m", "companion", "plan", "--model", "llama-3.1-405b", "--gpus", "16",
           "--seq-len", "8192", "--batch", "4M-tokens", "--simulate", "0", "--host-gib", "0"]
    text = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert text.returncode == 1, text.stderr
    assert "No plan of data parallelism, ZeRO, checkpointing or offload fits" in text.stdout
    assert "8 to a node" in text.stdout and "No layout fits" in text.stdout


def test_the_70b_of_torchtitan_table_4_within_10_percent_below():
    """torchtitan's measured Llama 3.1 70B (docs/performance.md, Table 4; see parallel_published):
    FSDP 32 x TP 8, 16 sequences of 8,192 tokens a GPU, full checkpointing, 71.9 GiB reserved.
    Priced with ZeRO-3 as FSDP2 and DTensor's tensor parallelism: 65.88 GiB, 8.4% under (the
    terms left out add bytes: `torchtitan_error`). The tensors alone are 14.7% under, so the CUDA
    lines are needed to meet the tolerance; priced as ZeRO-1 (bf16 weights and an fp32 main
    gradient whole on each rank) it would be 25% over, as ZeRO-0 158% over."""
    err, found = torchtitan_error(TORCHTITAN_70B)
    assert -0.10 <= err <= 0
    lines = {x.name: x.value for x in found.memory}
    per_rank = 80 * (855_638_016 // 8 + 2 * 8192) + 2 * 128_256 * 8192 // 8 + 8192
    assert lines["weights (fp32 shards)"] == 4 * per_rank // 32
    assert lines["optimizer (Adam m and v, fp32 shards)"] == 8 * per_rank // 32
    assert lines["activations"] == 80 * 2 * 16 * 8192 * 8192 // 8      # each layer's input
    assert lines["loss (bf16 logits, fp32 copy, shifted, exp)"] == 14 * 16 * 8192 * 128_256 // 8
    assert lines["norm outputs gathered for tensor parallel (DTensor)"] == \
        2 * 2 * 16 * 8192 * 8192 * 7 // 8                          # the recomputed layer's two
    assert not -0.10 <= found.total_bytes / (71.9 * 2 ** 30) - 1 <= 0
    for zero in (0, 1):
        wrong = dataclasses.replace(TORCHTITAN_70B,
                                    layout=dataclasses.replace(TORCHTITAN_70B.layout, zero=zero))
        assert not -0.10 <= torchtitan_error(wrong)[0] <= 0


@pytest.mark.parametrize("run", TORCHTITAN_405B, ids=lambda r: r.quote.split("|")[1].strip())
def test_the_405b_runs_of_torchtitan_are_reported_under_their_measured_peaks(run):
    """Tables 5 and 6 (405B, FSDP x TP 8 x PP 8, with CP): 30% to 37% under the reserved peaks:
    the model lacks what pipelining adds under FSDP (`torchtitan_error` names it); a lower bound
    here, not a fit."""
    err, _ = torchtitan_error(run)
    assert -0.40 <= err < -0.25
