"""companion.estimate and companion.estimate_offload against published figures.

Each test holds figures as their source prints them, says where they are printed (paper and
table, page and section, or repository, path and function), and checks the package's number with
a stated tolerance: the rounding the source used, or zero. Where the package's number differs
from a source, the test pins the difference and its comment says why. Sources:

  ZeRO: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
      Parameter Models", SC 2020, arXiv:1910.02054 (v3).
  Korthikanti: Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, "Reducing
      Activation Recomputation in Large Transformer Models", MLSys 2023, arXiv:2205.05198.
  Playbook: Tazi et al., "The Ultra-Scale Playbook: Training LLMs on GPU Clusters", Hugging Face,
      2025, https://huggingface.co/spaces/nanotron/ultrascale-playbook (read from its mirror
      github.com/vinjn/nanotron-ultrascale-playbook: index.html and fragments/).
  Megatron-LM: github.com/NVIDIA/Megatron-LM, docs/api-guide/dist_optimizer.md.
  DeepSpeed: https://deepspeed.readthedocs.io/en/latest/memory.html (source:
      github.com/deepspeedai/DeepSpeed docs/code-docs/source/memory.rst), the estimators in
      deepspeed/runtime/zero/stage_1_and_2.py and stage3.py, and Hugging Face Transformers'
      DeepSpeed guide (github.com/huggingface/transformers docs/source/en/deepspeed.md,
      "Memory requirements").
"""
import math
from fractions import Fraction

import pytest

from companion import estimate as E
from companion.estimate_offload import offload_placement

GB, GiB = 10**9, 2**30


def _printed(value: Fraction, digits: int, rule: str) -> Fraction:
    """`value` with `digits` decimals, rounded half up ("round") or cut ("floor")."""
    unit = Fraction(1, 10**digits)
    return math.floor(value / unit + (Fraction(1, 2) if rule == "round" else 0)) * unit


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def _largest_fitting(budget: int, **options) -> int:
    """The largest parameter count whose model states fit `budget` bytes (bisection: they grow
    with the count). The package has no such function; Table 2 of the ZeRO paper needs it."""
    lo, hi = 0, 1
    while E.model_states(hi, **options).total <= budget:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if E.model_states(mid, **options).total <= budget else (lo, mid)
    return lo


def _without_attention_scores(batch: int, seq_len: int, width: int, heads: int) -> int:
    """`transformer_layer_activations` less its terms that grow with the heads (the (s, s)
    attention scores): the count is linear in the heads, f(a) = c + a·q, so c = 2·f(a) - f(2a).
    What Korthikanti's selective recomputation keeps; the package has no option for it."""
    one, two = (E.transformer_layer_activations(batch, seq_len, width, a)
                for a in (heads, 2 * heads))
    return 2 * one - two


# ---------------------------------------------------------------------------------------------
# ZeRO paper

def test_zero_section_3_1_mixed_precision_adam_is_2_plus_2_plus_12_bytes():
    """ZeRO §3.1: fp16 weights 2Ψ, fp16 gradients 2Ψ, fp32 master weights, momentum and variance
    4Ψ each (K = 12): 16Ψ; "GPT-2 with 1.5 Billion parameters ... at least 24 GB". Exact."""
    states = E.model_states(1.5e9, optimizer="adam", precision="mixed")
    assert (states.params, states.grads, states.optimizer) == (2 * 1.5e9, 2 * 1.5e9, 12 * 1.5e9)
    assert states.total == 24 * GB


def test_zero_figure_1_per_device_model_states_of_7_5b_on_64_ranks():
    """ZeRO Figure 1 (and §5.1-5.3): Ψ = 7.5B, N_d = 64, K = 12. Baseline 2Ψ + 2Ψ + KΨ =
    120 GB; P_os 2Ψ + 2Ψ + KΨ/N_d = 31.4 GB; P_os+g 2Ψ + (2 + K)Ψ/N_d = 16.6 GB; P_os+g+p
    (2 + 2 + K)Ψ/N_d = 1.9 GB. GB = 10⁹ bytes; the figure rounds to 0.1 GB (the package's
    exact values: 120, 31.40625, 16.640625, 1.875)."""
    psi, n = 7.5e9, 64
    stages = [E.model_states(psi, precision="mixed", zero_stage=s, world_size=n) for s in range(4)]
    assert [(s.params, s.grads, s.optimizer) for s in stages] == [
        (2 * psi, 2 * psi, 12 * psi),
        (2 * psi, 2 * psi, 12 * psi / n),
        (2 * psi, 2 * psi / n, 12 * psi / n),
        (2 * psi / n, 2 * psi / n, 12 * psi / n)]
    printed = ["120", "31.4", "16.6", "1.9"]
    for states, text in zip(stages, printed):
        assert _printed(Fraction(states.total, GB), _decimals(text), "round") == Fraction(text)


# ZeRO Table 1: per-device model states (GB) by DP degree, columns P_os, P_os+g, P_os+g+p.
ZERO_TABLE_1 = {
    7.5e9: [("120", "120", "120"), ("52.5", "41.3", "30"), ("35.6", "21.6", "7.5"),
            ("31.4", "16.6", "1.88"), ("30.4", "15.4", "0.47"), ("30.1", "15.1", "0.12")],
    128e9: [("2048", "2048", "2048"), ("896", "704", "512"), ("608", "368", "128"),
            ("536", "284", "32"), ("518", "263", "8"), ("513", "257", "2")],
    1e12: [("16000", "16000", "16000"), ("7000", "5500", "4000"), ("4750", "2875", "1000"),
           ("4187", "2218", "250"), ("4046", "2054", "62.5"), ("4011", "2013", "15.6")],
}
DP_DEGREES = (1, 4, 16, 64, 256, 1024)


@pytest.mark.parametrize("psi, rule", [(7.5e9, "round"), (128e9, "floor"), (1e12, "floor")])
def test_zero_table_1_model_states_by_dp_degree(psi, rule):
    """ZeRO Table 1 (§5.4), all 54 cells, GB = 10⁹ bytes. Every cell is the package's exact
    value written to the printed decimals: the 7.5B column rounds half up (41.25 -> 41.3,
    1.875 -> 1.88), the 128B and 1T columns cut (513.5 -> 513, 4187.5 -> 4187, 2013.67 -> 2013).
    Tolerance: that rounding, nothing more."""
    for n, row in zip(DP_DEGREES, ZERO_TABLE_1[psi]):
        for stage, text in zip((1, 2, 3), row):
            total = E.model_states(psi, precision="mixed", zero_stage=stage, world_size=n).total
            got = _printed(Fraction(total, GB), _decimals(text), rule)
            assert got == Fraction(text), (psi, n, stage, text, total / GB)


def test_zero_table_1_bold_cells_are_the_first_that_fit_a_32_gb_v100():
    """ZeRO Table 1's caption: "Bold-faced text are the combinations for which the model can fit
    into a cluster of 32GB V100 GPUs" (model states only). The bold cells are, per model and
    stage, the smallest DP degree at which the package's total is at most 32·10⁹ bytes; the 128B
    model with P_os+g+p on 64 ranks needs exactly 32 GB."""
    bold = {(7.5e9, 1): 64, (7.5e9, 2): 16, (7.5e9, 3): 4, (128e9, 3): 64, (1e12, 3): 1024}
    first_fit = {}
    for psi in ZERO_TABLE_1:
        for stage in (1, 2, 3):
            fits = [n for n in DP_DEGREES if E.model_states(
                psi, precision="mixed", zero_stage=stage, world_size=n).total <= 32 * GB]
            if fits:
                first_fit[psi, stage] = fits[0]
    assert first_fit == bold


# ZeRO Table 2: MP degree, GPUs, max theoretical model size (Baseline, P_os, P_os+g, P_os+g+p),
# measured model size (Baseline, ZeRO-DP P_os).
ZERO_TABLE_2 = [
    (1, 64, ("2B", "7.6B", "14.4B", "128B"), ("1.3B", "6.2B")),
    (2, 128, ("4B", "15.2B", "28.8B", "256B"), ("2.5B", "12.5B")),
    (4, 256, ("8B", "30.4B", "57.6B", "0.5T"), ("5B", "25B")),
    (8, 512, ("16B", "60.8B", "115.2B", "1T"), ("10B", "50B")),
    (16, 1024, ("32B", "121.6B", "230.4B", "2T"), ("20B", "100B")),
]


def _size(text: str) -> tuple[Fraction, int]:
    """("7.6B") -> (7.6e9, decimals); T is 10¹² here."""
    return Fraction(text[:-1]) * {"B": 10**9, "T": 10**12}[text[-1]], _decimals(text[:-1])


def test_zero_table_2_largest_model_per_configuration():
    """ZeRO Table 2 (cited in §9): the largest model whose model states fit a 32 GB V100 (32·10⁹
    bytes) with model parallelism MP and N_d = GPUs / MP = 64 data-parallel ranks. The package
    has no such function: `_largest_fitting` bisects `model_states` for one MP shard (Ψ / MP
    parameters), times MP. Exact: 2B·MP, 7.642B·MP (32/4.1875), 14.42B·MP (32/2.21875),
    128B·MP. The printed values:
      - Baseline and P_os+g+p are the exact values written to the printed digits (512B as
        "0.5T", 1024B and 2048B as "1T" and "2T": 2.3% below);
      - P_os and P_os+g print the MP-1 value cut to 0.1B (7.6B, 14.4B) times MP, so rows with
        MP > 1 sit up to 0.6% below the exact value (15.2B against 15.28B);
      - the measured sizes (model states plus activations and buffers) are below the maximum."""
    mp1 = {}
    for mp, gpus, theoretical, measured in ZERO_TABLE_2:
        n_d = gpus // mp
        exact = [mp * _largest_fitting(32 * GB, precision="mixed", zero_stage=stage,
                                       world_size=n_d) for stage in (0, 1, 2, 3)]
        for stage, (text, value) in enumerate(zip(theoretical, exact)):
            printed, digits = _size(text)
            unit = 10**12 if text.endswith("T") else 10**9
            if mp == 1:
                mp1[stage] = printed
                rule = "round" if stage in (0, 3) else "floor"
                assert _printed(Fraction(value, unit), digits, rule) * unit == printed
            elif stage in (1, 2):
                assert printed == mp * mp1[stage]
                assert 0 <= (value - printed) / value < Fraction(6, 1000), (mp, text, value)
            else:
                assert _printed(Fraction(value, unit), digits, "round") * unit == printed
        assert _size(measured[0])[0] < exact[0] and _size(measured[1])[0] < exact[1]


def test_zero_section_3_2_gpt2_activations_differ_from_korthikanti_count():
    """ZeRO §3.2: "the 1.5B parameter GPT-2 model trained with sequence length of 1K and batch
    size of 32 requires about 60 GB" of activations; its footnote 3 counts "about 12 ×
    hidden_dim × batch × seq_length × transformer_layers" values, 2 bytes each: 60.4 GB.
    The package counts Korthikanti et al.'s itemized sbh(34 + 5as/h) per layer (GPT-2 XL:
    h = 1600, 48 layers, 25 heads, so 5as/h = 80): 114 bytes per value of sbh against the
    footnote's 24, 4.75x (287 GB). The footnote is a rough count that leaves out the attention
    scores (80 of the 114) and dropout masks; the package follows the itemized count. Even
    without the scores (selective recomputation, 34·sbh) the package is 34/24 of the figure."""
    s, b, h, depth, heads = 1024, 32, 1600, 48, 25
    footnote = 12 * h * b * s * depth * 2
    assert footnote == pytest.approx(60 * GB, rel=0.01)
    layers = depth * E.transformer_layer_activations(b, s, h, heads)
    assert Fraction(layers, footnote) == Fraction(34 + 5 * heads * s // h, 24) == Fraction(19, 4)
    kept = depth * _without_attention_scores(b, s, h, heads)
    assert Fraction(kept, footnote) == Fraction(34, 24)


# ---------------------------------------------------------------------------------------------
# Megatron-LM's distributed optimizer

@pytest.mark.parametrize("options, whole, sharded", [
    ({"precision": "fp32"}, 16, (8, 8)),                            # fp32 params, fp32 grads
    ({"precision": "mixed", "fp32_grads": True}, 18, (6, 12)),      # bf16 params, fp32 grads
])
def test_megatron_bytes_per_parameter(options, whole, sharded):
    """Megatron-LM, docs/api-guide/dist_optimizer.md, the table of "theoretical number of bytes
    per parameter": 16 and 8 + 8/d for fp32; 18 and 6 + 12/d for bf16 parameters with fp32
    gradients (2 + 4 whole: the fp32 gradients are the ones reduced and stepped on; the fp32
    master weights and Adam's moments sharded). The distributed optimizer is ZeRO stage 1 with
    `fp32_grads`. Exact."""
    n, d = 2**20, 8
    assert E.model_states(n, **options).total == whole * n
    stage_1 = E.model_states(n, **options, zero_stage=1, world_size=d).total
    assert stage_1 == sharded[0] * n + sharded[1] * n // d


def test_megatron_fp16_row_lies_between_the_package_stages():
    """The same table's fp16 row: 20 bytes, 4 + 16/d distributed. The 20 is the package's
    `fp32_grad_buffer` layout (2 + 2 + 4 + 4 + 8), exactly. Distributed, Megatron keeps the
    16-bit parameters and gradients whole (4) and shards the fp32 main gradients with the
    optimizer state (16/d). `model_states` files the fp32 buffer under gradients, which its
    stage 1 keeps whole (8 + 12/d: DeepSpeed's BF16_Optimizer, whose fp32 gradient buffer is
    full-size, deepspeed/runtime/bf16_optimizer.py) and its stage 2 shards together with the
    16-bit gradients (2 + 18/d). Megatron's layout has no option here: at stage 1 the package
    says 4 - 4/d bytes per parameter more (3.5 at d = 8), at stage 2 2 - 2/d less."""
    n, d = 2**20, 8
    assert E.model_states(n, precision="mixed", fp32_grad_buffer=True).total == 20 * n
    megatron = 4 * n + 16 * n // d
    stage_1, stage_2 = (E.model_states(n, precision="mixed", fp32_grad_buffer=True,
                                       zero_stage=s, world_size=d).total for s in (1, 2))
    assert stage_1 - megatron == 4 * n - 4 * n // d
    assert megatron - stage_2 == 2 * n - 2 * n // d


# ---------------------------------------------------------------------------------------------
# The Ultra-Scale Playbook

@pytest.mark.parametrize("billions, without_fp32_acc, with_fp32_acc", [
    (1, 16, 20), (7, 112, 140), (70, 1120, 1400), (405, 6480, 8100)])
def test_playbook_model_state_table(billions, without_fp32_acc, with_fp32_acc):
    """Playbook, "First Steps: Training on One GPU" > "Memory usage in transformers" > "Memory
    for weights/grads/optimizer states", the table (GB = 10⁹ bytes): "FP32 or BF16 w/o FP32 grad
    acc" is 4 + 4 + 8 or 2 + 2 + 4 + 8 bytes per parameter; "BF16 w/ FP32 grad acc" adds the
    4-byte fp32 gradients beside the bf16 ones (`fp32_grad_buffer`). Exact."""
    n = billions * 10**9
    assert E.model_states(n, precision="fp32").total == without_fp32_acc * GB
    assert E.model_states(n, precision="mixed").total == without_fp32_acc * GB
    assert E.model_states(n, precision="mixed", fp32_grad_buffer=True).total == with_fp32_acc * GB


def test_playbook_zero_formulas_with_fp32_gradient_accumulation():
    """Playbook, "Zero Redundancy Optimizer (ZeRO)" > "Memory usage revisited" and the ZeRO-1,
    -2 and -3 subsections: ZeRO-1 2Ψ + 2Ψ + kΨ/N_d, ZeRO-2 2Ψ + (2Ψ + kΨ)/N_d, ZeRO-3
    (2Ψ + 2Ψ + kΨ)/N_d with k = 12; and its aside: "If you're using FP32 gradient accumulation
    with ZeRO-2 or ZeRO-3, you would need to add an additional 4Ψ/N_d to the gradient term."
    Exact (Ψ a multiple of N_d)."""
    psi, n, k = 64 * 10**9, 64, 12
    zero = {s: E.model_states(psi, precision="mixed", zero_stage=s, world_size=n).total
            for s in (1, 2, 3)}
    assert zero == {1: 4 * psi + k * psi // n, 2: 2 * psi + (2 + k) * psi // n,
                    3: (4 + k) * psi // n}
    for stage in (2, 3):
        acc = E.model_states(psi, precision="mixed", fp32_grad_buffer=True, zero_stage=stage,
                             world_size=n).total
        assert acc == zero[stage] + 4 * psi // n


def test_playbook_70b_weights_tip():
    """Playbook, "Data Parallelism" > "Our journey up to now", aside: "multiplying by 2 - e.g.,
    70B → 140 GB (= 133 GiB)". The package's 140·10⁹ bytes of bf16 weights are exact; in GiB
    they are 130.4, not 133: the source is 2% high. 133 is what 140·10⁹ / 2²⁰ / 1000 gives
    (MiB divided by 1000), probably how it was reached."""
    weights = E.model_states(70 * 10**9, precision="bf16").params
    assert weights == 140 * GB
    assert round(weights / GiB, 1) == 130.4
    assert int(weights / 2**20 / 1000) == 133


# Playbook, "Memory for activations", the figure after the m_act formula (data in
# fragments/memusage_activations.html), bs = 1, "GB memory" that are GiB (2³⁰): per model
# (hidden h, layers L, heads a, read off its bars), for seq = 1024 ... 16384, the "activations"
# and "parameters" bars.
PLAYBOOK_SEQ = (1024, 2048, 4096, 8192, 16384)
PLAYBOOK_CHART = {
    "Meta-Llama-3.1-8B": ((4096, 32, 32),
                          (9.25390625, 28.5078125, 97.015625, 354.03125, 1348.0625),
                          (25.979034423828125, 25.994659423828125, 26.025909423828125,
                           26.088409423828125, 26.213409423828125)),
    "Meta-Llama-3.1-70B": ((8192, 80, 64),
                           (46.2578125, 142.515625, 485.03125, 1770.0625, 6740.125),
                           (243.97711181640625, 244.00836181640625, 244.07086181640625,
                            244.19586181640625, 244.44586181640625)),
    "Meta-Llama-3.1-405B": ((16384, 126, 128),
                            (145.703125, 448.90625, 1527.8125, 5575.625, 21231.25),
                            (1519.99072265625, 1520.05322265625, 1520.17822265625,
                             1520.42822265625, 1520.92822265625)),
}


@pytest.mark.parametrize("model", PLAYBOOK_CHART)
def test_playbook_activation_memory_by_sequence_length(model):
    """Playbook, "Memory for activations": m_act = L·seq·bs·h·(34 + 5·n_heads·seq/h), and its
    figure for Llama 3.1 8B, 70B and 405B. Every bar is, to the byte, L × the package's
    `transformer_layer_activations` (Korthikanti's eq. 1, 16-bit, dropout) plus seq·bs·h bytes:
    the embedding dropout's mask, which `transformer_activations` counts too (Korthikanti §4.3).
    `transformer_activations` is larger than the bar by the final LayerNorm's and the head's
    inputs (4·seq·h) and the fp32 logits (4·seq·vocab), which the figure leaves out: 0.5 GiB at
    seq 1024 for the 8B, 8.8 GiB at 16384 for the 405B.

    The "parameters" bars are 4 bytes times the playbook's count h·v + seq·h + L·(12h² + 13h) +
    2h (v = 128256, with learned positions: the figure's own GPT-like count, not Llama's), which
    is `gpt_params` without the course GPT's untied head and its bias; gradients 4 and Adam 8
    bytes per parameter: fp32 `model_states`. Exact."""
    (h, depth, heads), activations, parameters = PLAYBOOK_CHART[model]
    vocab = 128256
    for seq, acts_gib, params_gib in zip(PLAYBOOK_SEQ, activations, parameters):
        layers = depth * E.transformer_layer_activations(1, seq, h, heads)
        assert layers == depth * seq * h * 34 + depth * 5 * heads * seq * seq
        assert (layers + seq * h) / GiB == acts_gib
        full = E.transformer_activations(1, seq, h, depth, heads, vocab)
        assert full - (layers + seq * h) == 4 * seq * h + 4 * seq * vocab
        n = E.gpt_params(vocab, seq, h, depth) - h * vocab - vocab
        states = E.model_states(n, precision="fp32")
        assert states.params / GiB == params_gib
        assert (states.grads, states.optimizer) == (states.params, 2 * states.params)


# ---------------------------------------------------------------------------------------------
# Korthikanti et al.

# Korthikanti Table 3: model, attention heads a, hidden size h, layers, micro-batch b;
# §6: s = 2048, v = 51200.
KORTHIKANTI_TABLE_3 = {"22B": (64, 6144, 48, 4), "175B (GPT-3)": (96, 12288, 96, 1),
                       "530B (MT-NLG)": (128, 20480, 105, 1), "1T": (160, 25600, 128, 1)}


@pytest.mark.parametrize("model", KORTHIKANTI_TABLE_3)
def test_korthikanti_equation_1_per_layer(model):
    """Korthikanti §4.1, eq. 1 (Table 2, "no parallelism"): activations per layer
    sbh(34 + 5as/h) bytes, 16-bit values and 1-byte dropout masks; the package's default
    (`dropout=True`, 16-bit) is it exactly, on the Table 3 models and on odd sizes."""
    heads, h, _, b = KORTHIKANTI_TABLE_3[model]
    for s, batch, width, a in ((2048, b, h, heads), (77, 3, 96, 5), (1, 1, 8, 1)):
        assert E.transformer_layer_activations(batch, s, width, a) == (
            s * batch * width * 34 + 5 * a * s * s * batch)
        assert E.transformer_layer_activations(batch, s, width, a, precision="fp16") == (
            E.transformer_layer_activations(batch, s, width, a))


def test_korthikanti_selective_recomputation():
    """Korthikanti Table 2, "selective activation recomputation" (t = 1): 34·sbh per layer; §5:
    for GPT-3 (a = 96, s = 2048, h = 12288) 5as/h = 80, for MT-NLG (a = 128, h = 20480) 64, and
    selective recomputation saves "70% and 65%" of the activations. The package has no
    selective-recomputation option: selective recomputation drops exactly the terms that grow
    with the heads (the as²b of QKᵀ, softmax, its dropout and attention over V), and the
    package's count is linear in the heads, so what it keeps is `_without_attention_scores`.
    Savings rounded to the percent, as printed."""
    s = 2048
    for model, saved in (("175B (GPT-3)", 0.70), ("530B (MT-NLG)", 0.65)):
        heads, h, _, b = KORTHIKANTI_TABLE_3[model]
        kept = _without_attention_scores(b, s, h, heads)
        assert kept == 34 * s * b * h
        full = E.transformer_layer_activations(b, s, h, heads)
        assert Fraction(full, s * b * h) - 34 == {"175B (GPT-3)": 80, "530B (MT-NLG)": 64}[model]
        assert round(1 - kept / full, 2) == saved


def test_korthikanti_section_4_3_total_and_its_share_claim():
    """Korthikanti §4.3: beyond the L layers, the embedding dropout's mask sbhp/t, the final
    LayerNorm's input 2sbh/t, the output layer's input 2sbh/t and the fp32 logits 4sbv/t; with
    t = p = 1, sbh·(1 + 4 + 4v/h). `transformer_activations` is that sum exactly.
    The paper adds "for a model with 22B parameters, these extra terms account for less than
    0.01% of the total"; for the 22B of Table 3 (p = 1, v = 51200, s = 2048, b = 4) they are
    0.56% in the package's count and in the paper's own formula. The claim holds read as a
    fraction (0.0056 < 0.01), not as a percentage."""
    heads, h, depth, b = KORTHIKANTI_TABLE_3["22B"]
    s, v = 2048, 51200
    total = E.transformer_activations(b, s, h, depth, heads, v)
    layers = depth * E.transformer_layer_activations(b, s, h, heads)
    assert total - layers == s * b * h * 5 + 4 * s * b * v
    share = (total - layers) / total
    assert round(share, 4) == 0.0056
    assert 0.0001 < share < 0.01


# ---------------------------------------------------------------------------------------------
# DeepSpeed's estimators, as its documentation prints them

def _t5_params(d_model: int, d_ff: int, heads: int, d_kv: int, layers: int, vocab: int,
               gated: bool) -> tuple[int, int]:
    """Parameters of transformers' `T5Model` (AutoModel: no LM head; the shared embedding once,
    as DeepSpeed's `model_to_params` counts it by data_ptr) and its largest module's own
    parameters (the embedding). Per layer: attention q, k, v, o (4·d·heads·d_kv), the
    feed-forward (2 or, gated, 3 matrices d·d_ff), a weight-only LayerNorm before each; decoder
    layers add cross-attention; 32 relative-position buckets per head in each stack's first
    layer; a final LayerNorm per stack."""
    attention, mlp = 4 * d_model * heads * d_kv, (3 if gated else 2) * d_model * d_ff
    encoder = layers * (attention + mlp + 2 * d_model) + 32 * heads + d_model
    decoder = layers * (2 * attention + mlp + 3 * d_model) + 32 * heads + d_model
    return vocab * d_model + encoder + decoder, vocab * d_model


# t5-3b's config.json: d_model 1024, d_ff 16384, 32 heads of d_kv 128, 24 layers, vocab 32128.
# The docs print "2851M total params, 32M largest layer params".
T5_3B = _t5_params(1024, 16384, 32, 128, 24, 32128, gated=False)
# bigscience/T0_3B (T5 v1.1 XL, LM-adapted): d_model 2048, d_ff 5120 gated-gelu, 32 heads of
# d_kv 64, 24 layers, vocab 32128. The docs print "2783M total params, 65M largest layer params".
T0_3B = _t5_params(2048, 5120, 32, 64, 24, 32128, gated=True)

# (offload_params, offload_optimizer, zero_init): per CPU, per GPU, as printed (GiB, 2 decimals).
ZERO3_OPTIONS = [("cpu", "cpu", True), ("cpu", "cpu", False), (None, "cpu", True),
                 (None, "cpu", False), (None, None, True), (None, None, False)]
DEEPSPEED_ZERO3 = {
    # memory.rst, ZeRO3, estimate_zero3_model_states_mem_needs_all_cold(2851e6, 32e6), 8 GPUs.
    "t5-3b cold": ((int(2851e6), int(32e6)), 8, [
        ("71.69", "0.12"), ("127.45", "0.12"), ("63.72", "0.78"), ("127.45", "0.78"),
        ("1.43", "6.09"), ("127.45", "6.09")]),
    # memory.rst, ZeRO3, estimate_zero3_model_states_mem_needs_all_live(t5-3b), 8 GPUs.
    "t5-3b live": (T5_3B, 8, [
        ("71.71", "0.12"), ("127.48", "0.12"), ("63.74", "0.79"), ("127.48", "0.79"),
        ("1.47", "6.10"), ("127.48", "6.10")]),
    # transformers docs/source/en/deepspeed.md, "Memory requirements": T0_3B live, 1 GPU.
    "T0_3B live": (T0_3B, 1, [
        ("70.00", "0.25"), ("70.00", "0.25"), ("62.23", "5.43"), ("62.23", "5.43"),
        ("0.37", "46.91"), ("15.56", "46.91")]),
}


@pytest.mark.parametrize("case", DEEPSPEED_ZERO3)
def test_deepspeed_zero3_estimator_as_documented(case):
    """`estimate_zero3_model_states_mem_needs_all_cold` / `_all_live`
    (deepspeed/runtime/zero/stage3.py) print f"{bytes/2**30:.2f}GB"; `offload_placement` with
    DeepSpeed's convention prints the same, every row: 0.005 GiB is the tolerance the print
    leaves. The live rows need the parameter counts, derived from the configs above and
    consistent with the printed "2851M"/"32M" and "2783M"/"65M"."""
    (n_params, largest), gpus, printed = DEEPSPEED_ZERO3[case]
    assert (n_params // 10**6, largest // 10**6) in ((2851, 32), (2783, 65))
    for (params, optimizer, zero_init), (host, device) in zip(ZERO3_OPTIONS, printed):
        placed = offload_placement(n_params, zero_stage=3, offload_optimizer=optimizer,
                                   offload_params=params, gpus_per_node=gpus,
                                   largest_layer_params=largest, zero_init=zero_init)
        assert (f"{placed.host / GiB:.2f}", f"{placed.device / GiB:.2f}") == (host, device)


@pytest.mark.parametrize("n_params, host, device_now", [(int(2851e6), "127.45", "11.28"),
                                                        (T5_3B[0], "127.48", "11.29")])
def test_deepspeed_zero2_estimator_and_the_docs_older_figure(n_params, host, device_now):
    """memory.rst, ZeRO2, `estimate_zero2_model_states_mem_needs_all_cold(2851e6)` and
    `_all_live(t5-3b)`, 8 GPUs: per CPU 127.45 / 127.48 GB for both rows, per GPU 5.31 GB with the
    optimizer offloaded and 15.93 GB without. The package matches every figure but the last:
    it gives 11.28 / 11.29 GB, the estimator's code since DeepSpeed PR #5099 (June 2024,
    stage_1_and_2.py `estimate_zero2_model_states_mem_needs`: 2P + int(18P/N), 16-bit weights
    replicated, 16-bit and fp32 gradients, fp32 master weights and moments sharded). The docs'
    15.93 is the older 4P + int(16P/N), which counted 4-byte weights and gradients: the docs'
    example output predates the change. The new formula is `model_states`' stage 2 with
    `fp32_grad_buffer` (to the 18 bytes of int() and ceil)."""
    gpus = 8
    offloaded = offload_placement(n_params, zero_stage=2, offload_optimizer="cpu",
                                  gpus_per_node=gpus)
    kept = offload_placement(n_params, zero_stage=2, gpus_per_node=gpus)
    assert (f"{offloaded.host / GiB:.2f}", f"{offloaded.device / GiB:.2f}") == (host, "5.31")
    assert f"{kept.host / GiB:.2f}" == host
    older = 4 * n_params + int(16 * n_params / gpus)
    assert f"{older / GiB:.2f}" == "15.93"
    assert f"{kept.device / GiB:.2f}" == device_now
    states = E.model_states(n_params, precision="mixed", fp32_grad_buffer=True, zero_stage=2,
                            world_size=gpus)
    assert 0 <= states.total - kept.device < 18


def test_deepspeed_docs_discussion_figures():
    """memory.rst, "Discussion" > "GPU RAM": ZeRO-2 with the optimizer offloaded, "a 40GB GPU can
    fit ~11B param model ... the model weights take about 22GB"; ZeRO-3's worked example for
    t5-large on 4 GPUs, printed in MiB (`>> 20`): "total params: 737.67M, largest layer params:
    32.90M, largest layer memory: 125MB, case1 gpu memory: 3291MB, case2 gpu memory: 125MB,
    case3 gpu memory: 477MB". t5-large: d_model 1024, d_ff 4096, 16 heads of d_kv 64, 24 layers.
    Exact (MiB cut as `>>` cuts). Case 1 less the gathered layer is `model_states` at stage 3
    with fp32 gradients and no 16-bit ones (2 + 4 + 12 = 18 bytes, sharded)."""
    assert offload_placement(11 * 10**9, zero_stage=2, offload_optimizer="cpu").device == 22 * GB
    n_params, largest = _t5_params(1024, 4096, 16, 64, 24, 32128, gated=False)
    assert (f"{n_params / 1e6:.2f}", f"{largest / 1e6:.2f}") == ("737.67", "32.90")
    cases = {"case1": (None, None), "case2": ("cpu", "cpu"), "case3": (None, "cpu")}
    printed = {"case1": 3291, "case2": 125, "case3": 477}
    for case, (params, optimizer) in cases.items():
        placed = offload_placement(n_params, zero_stage=3, offload_params=params,
                                   offload_optimizer=optimizer, gpus_per_node=4,
                                   largest_layer_params=largest)
        assert placed.device >> 20 == printed[case]
    case_1 = offload_placement(n_params, zero_stage=3, gpus_per_node=4,
                               largest_layer_params=largest).device
    sharded = E.model_states(n_params, precision="mixed", fp32_grads=True, zero_stage=3,
                             world_size=4).total
    assert (4 * largest) >> 20 == 125 and 0 <= sharded - (case_1 - 4 * largest) < 18
