"""companion.plan.budget: a plan fits the whole budget, with a GPU's lines counted by hand."""
import functools

import pytest

from companion import allocator
from companion.cost import gpus
from companion.models import GPT
from companion.plan import Candidate, GPTShape, plan, predict_seconds
from companion.plan import budget as budgets
from companion.plan.costmodel import CostModel

MiB, GiB = 2**20, 2**30
XL = functools.partial(GPT, 50257, 1024, 1600, 48, 25, fused_attention=True)


def test_lines_of_a_cuda_step_by_hand():
    shape = GPTShape.of(XL)
    found = {o.name: o for o in budgets.lines(shape, Candidate(4, 4, offload=True, precision=
                                                                "mixed"),
                                              device_type="cuda", gpu=gpus.gpu("H100 SXM"),
                                              world_size=1)}
    assert found["CUDA context"].bytes == 512 * MiB and not found["CUDA context"].in_allocator
    assert found["cuBLAS workspace"].bytes == 32 * MiB                # Hopper
    # (4, 1024 rounded to 1024, 25 heads, 64 rounded to 64) fp32 + (4, 25, 1024) fp32
    assert found["FlashAttention backward scratch"].bytes == 4 * 4 * 1024 * 25 * 64 + 4 * 4 * 25 * 1024
    assert found["record_stream backlog"].bytes == 2 * 50257 * 1600     # bf16 embedding's grad
    assert found["fp32 conversion temporary (load)"].bytes == 4 * 50257 * 1600
    assert budgets.lines(shape, Candidate(4), device_type="cpu") == []
    ampere = budgets.lines(shape, Candidate(4), device_type="cuda", gpu=gpus.gpu("A100 80GB"),
                           world_size=8)
    assert {o.name: o.bytes for o in ampere}["cuBLAS workspace"] == 8_519_680   # :4096:2:16:8
    # NCCL: one communicator as measured (nccl#864: about 1.6 GB), not 4 MiB buffers x channels
    assert {o.name: o.bytes for o in ampere}["NCCL buffers"] == 1_600_000_000
    assert "NCCL buffers" not in {o.name for o in budgets.lines(
        shape, Candidate(4), device_type="cuda", gpu=gpus.gpu("A100 80GB"), world_size=1)}


def test_flash_attention_scratch_adds_the_expanded_dk_dv_under_grouped_query_attention():
    from companion.models import Llama
    B, T, H, KV, D = 2, 4096, 32, 8, 128                  # Llama 3 8B's attention
    gqa = allocator.flash_backward_workspace(B, T, H, D, kv_heads=KV, itemsize=2)
    mha = allocator.flash_backward_workspace(B, T, H, D)
    assert mha.bytes == 4 * B * T * H * D + 4 * B * H * T                 # dq_accum, softmax_d
    assert gqa.bytes - mha.bytes == 2 * 2 * B * T * H * D                 # dk_, dv_expanded bf16
    assert "dk_expanded" in gqa.source
    assert allocator.flash_backward_workspace(B, T, H, D, kv_heads=H).bytes == mha.bytes
    llama = functools.partial(Llama, 512, 256, 128, 2, 8, kv_heads=2)
    shape = GPTShape.of(llama)
    found = {o.name: o.bytes for o in budgets.lines(shape, Candidate(2, precision="autocast"),
                                                    device_type="cuda",
                                                    gpu=gpus.gpu("H100 SXM"))}
    d = 128 // 8
    t = 256                                                              # already a multiple of 128
    assert found["FlashAttention backward scratch"] == (
        4 * 2 * t * 8 * 32 + 4 * 2 * 8 * t + 2 * 2 * 2 * 256 * 8 * d)  # d 16 rounds up to 32


def test_grouped_query_attention_in_fp32_on_cuda_counts_the_math_kernel_not_flash():
    # SDPA has no fused kernel for GQA in fp32 on CUDA: the math path saves each block's
    # (B, H, T, T) weights and k, v expanded to every head, which the CPU's simulated step
    # does not show (review of issue 52: a plan printed as fitting with a FlashAttention line)
    from companion.models import Llama
    llama = functools.partial(Llama, 512, 256, 128, 4, 8, kv_heads=2)   # 4 blocks
    shape = GPTShape.of(llama)
    card = gpus.gpu("H100 SXM")
    B, T, H, C, kv = 2, 256, 8, 128, 2 * 16

    def names(cand):
        return {o.name: o.bytes for o in budgets.lines(shape, cand, device_type="cuda", gpu=card)}

    fp32, bf16 = names(Candidate(B)), names(Candidate(B, precision="autocast"))
    math = "SDPA's math kernel: saved attention weights and expanded keys and values"
    assert fp32[math] == 4 * 4 * (B * H * T * T + 2 * B * T * (C - kv))
    assert "FlashAttention backward scratch" not in fp32 and math not in bf16
    assert "FlashAttention backward scratch" in bf16
    two = names(Candidate(B, segments=2))                 # one segment's blocks at a time
    assert two[math] == fp32[math] // 2
    plain = functools.partial(Llama, 512, 256, 128, 4, 8, kv_heads=8)  # no GQA: flash runs
    assert budgets.math_attention_bytes(GPTShape.of(plain), Candidate(B)) == 0


def test_a_predicted_fit_adds_the_lines_and_one_segment_of_headroom():
    found = [allocator.context(), allocator.Overhead("w", 10 * MiB, "s")]
    fit = budgets.fit_predicted(1 * GiB, 0, 4 * MiB, 2 * GiB, found, "cuda")
    assert fit.reserved == GiB + 10 * MiB + allocator.headroom(4 * MiB)
    assert fit.total == fit.reserved + 512 * MiB and fit.fits
    assert not budgets.fit_predicted(1 * GiB, 0, 4 * MiB, fit.total - 1, found, "cuda").fits
    cpu = budgets.fit_predicted(GiB, 0, 0, GiB, found, "cpu")
    assert cpu.fits and cpu.total == GiB                              # the CPU: tensors only


def test_the_whole_budget_is_used_and_the_gpu_named_sets_the_speeds():
    p = plan(XL, 16, budget="24 GiB", device="cuda", gpu="H100 SXM", verify=1,
             simulate_plain=False)
    r = p.chosen_row
    assert r.fit.how == "replayed" and r.fit.fits and r.fit.total <= 24 * GiB
    assert any(0.9 * 24 * GiB < x.fit.total <= 24 * GiB for x in p.rows)   # no 10% kept back
    names = [o.name for o in r.fit.lines]
    assert "CUDA context" in names and any(n.startswith("fragmentation") for n in names)
    expected = predict_seconds(p.shape, p.chosen, CostModel.for_gpu("H100 SXM"))["total"]
    assert r.seconds["total"] == pytest.approx(expected)
    slower = plan(XL, 16, budget="24 GiB", device="cuda", gpu="V100", verify=0)
    assert slower.chosen_row.seconds["total"] > r.seconds["total"]


def test_a_replayed_step_that_passes_the_cap_does_not_fit_and_says_where():
    import torch
    from companion.memory import track
    with track("cpu") as t:
        keep = [torch.empty(3 * MiB, dtype=torch.uint8) for _ in range(8)]   # 20 MiB segments
    fit = budgets.fit_simulated(t, 0, 600 * MiB, [allocator.context()], "cuda")
    assert fit.fits and fit.how == "replayed" and fit.total == 512 * MiB + 40 * MiB
    tight = budgets.fit_simulated(t, 0, 512 * MiB + 30 * MiB, [allocator.context()], "cuda")
    assert not tight.fits and tight.lines[-1].name == "out of memory when replayed"
    assert "would pass the cap" in tight.lines[-1].source
    del keep


def test_each_line_says_when_it_is_held_and_the_fit_reads_that_not_its_name():
    # A load-time line counts against the load (weights + it), never the step; a predicted bound
    # is dropped when the step is replayed. Renamed lines must keep both meanings.
    load = allocator.Overhead("a renamed temporary", 300 * MiB, "s", alive="load")
    step = allocator.Overhead("a renamed workspace", 10 * MiB, "s")
    fit = budgets.fit_predicted(GiB, 0, 4 * MiB, 4 * GiB, [load, step], "cuda")
    assert fit.reserved == GiB + 10 * MiB + allocator.headroom(4 * MiB)   # the load: not inside
    heavy = budgets.fit_predicted(GiB, 2 * GiB, 4 * MiB, 4 * GiB, [load, step], "cuda")
    assert heavy.reserved == 2 * GiB + 300 * MiB                          # weights + temporary
    assert fit.lines[-1].alive == "bound"
    import torch
    from companion.memory import track
    with track("cpu") as t:
        keep = torch.empty(3 * MiB, dtype=torch.uint8)
    small = allocator.Overhead("a small temporary", 5 * MiB, "s", alive="load")
    replayed = budgets.fit_simulated(t, 0, 4 * GiB, [small] + list(fit.lines[1:]), "cuda")
    assert all(o.alive != "bound" for o in replayed.lines)
    assert replayed.reserved == 20 * MiB + 10 * MiB                       # a segment + the step's
    with pytest.raises(ValueError, match="alive"):
        allocator.Overhead("x", 1, "s", alive="always")
    del keep


def test_a_named_plan_fits_the_cards_usable_bytes_not_its_nominal_size():
    from companion.plan.named import plan_named
    p = plan_named("gpt2-xl", gpu="RTX 4090", seq_len=1024, batch=16, verify=2, show=2)
    card = gpus.gpu("RTX 4090")
    assert p.budget == card.usable_bytes < card.memory_bytes
    assert all(r.fit.total <= card.usable_bytes for r in p.shown)
    forced = plan_named("gpt2-xl", gpu="RTX 4090", seq_len=1024, batch=16, verify=0,
                        budget=card.memory_bytes, show=1)
    assert forced.budget == card.memory_bytes                         # --budget still overrides


def _every_second_replay_runs_out(monkeypatch):
    """fit_simulated as the planner calls it, but the 2nd replay it makes does not fit (as a
    step whose free pieces are too small would not)."""
    from companion.plan import planner
    real, calls = budgets.fit_simulated, []

    def fake(tracker, weights, budget, found, device_type):
        fit = real(tracker, weights, budget, found, device_type)
        calls.append(fit)
        if len(calls) == 2:
            return budgets.Fit(False, budget + 1, fit.reserved, fit.lines + (
                allocator.Overhead("out of memory when replayed", 0, "made up"),), "replayed")
        return fit
    monkeypatch.setattr(planner.budgets, "fit_simulated", fake)
    return calls


def test_every_plan_listed_as_fitting_was_replayed_and_one_that_does_not_replay_is_not_listed(
        monkeypatch):
    import json
    from companion.plan.named import format_plans, plan_dict
    calls = _every_second_replay_runs_out(monkeypatch)
    p = plan(XL, 16, budget="24 GiB", device="cuda", gpu="H100 SXM", verify=2,
             simulate_plain=False, show=3)
    assert len(calls) >= 3 and len(p.shown) == 3
    failed = p.failed
    assert len(failed) == 1 and failed[0] not in p.shown
    assert all(r.fit.how == "replayed" and r.fit.fits for r in p.shown)
    data = plan_dict(p)
    json.dumps(data)
    assert [x["plan"] for x in data["plans"]] == [r.candidate.describe() for r in p.shown]
    assert failed[0].candidate.describe() not in [x["plan"] for x in data["plans"]]
    assert data["failed_when_simulated"] == [failed[0].candidate.describe()]
    assert {x["checked"] for x in data["plans"]} == {"replayed"}
    for x in data["plans"]:                   # the lines add up to the total (load line apart)
        assert x["gpu_bytes"] == sum(line["bytes"] for line in x["memory_lines"])
        assert x["gpu_bytes"] <= 24 * GiB and x["load_bytes"] < x["gpu_bytes"]
    text = format_plans(p)
    listed = [line for line in text.splitlines() if line[:3] in ("1. ", "2. ", "3. ", "4. ")]
    assert len(listed) == 3
    assert not any(failed[0].candidate.describe() + ":" in line for line in listed)
    assert "does not when replayed" in text and "Not counted:" in text
    assert "(load)" not in "\n".join(line for line in text.splitlines()
                                     if line.startswith("     "))  # not among the step's lines


def test_without_replays_the_listed_plans_say_they_are_unchecked():
    from companion.plan.named import format_plans, plan_dict
    p = plan(XL, 16, budget="24 GiB", device="cuda", gpu="H100 SXM", verify=0, show=2)
    assert {x["checked"] for x in plan_dict(p)["plans"]} == {"predicted"}
    assert "not replayed: unchecked" in format_plans(p)
    with pytest.raises(ValueError, match="show"):
        plan(XL, 16, budget="24 GiB", device="cuda", gpu="H100 SXM", verify=0, show=0)


def test_a_model_of_ones_own_on_cuda_is_chosen_by_its_replayed_step():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples.models import mha_lm
    from companion.plan.anymodel import plan_model
    p = plan_model(mha_lm, 32, budget="600 MiB", seq_len=64, device="cuda", gpu="RTX 4090",
                   allow=("accumulation", "checkpointing"))
    cap = 600 * MiB - sum(o.bytes for o in allocator.step_overheads(gpus.gpu("RTX 4090")))
    # the plain step's tensors fit, but not its segments: the old sieve would have chosen it
    assert p.plain.peak <= p.usable and p.chosen_row is not p.plain
    assert not p.plain.fit.fits and p.plain in p.failed
    assert p.chosen_row.fit.how == "replayed" and p.chosen_row.fit.total <= 600 * MiB
    assert p.chosen_row.fit.reserved - allocator.CUBLAS_DEFAULT <= cap           # 4090: 8.125 MiB
    assert all(r.fit.how == "replayed" and r.fit.fits for r in p.shown)
