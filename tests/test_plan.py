"""companion.plan: simulated steps equal real ones, predictions follow them, the chosen plans fit
when they train for real under memory_budget and learn what the unconstrained run learns, and
"nothing fits" says by how much."""
import functools

import pytest
import torch

from companion import estimate
from companion.models import GPT
from companion.plan import (EXACT, LOW_PRECISION, Candidate, CostModel, GPTShape, NothingFits,
                            candidates, plan, predict_memory, predict_seconds, simulate,
                            train_command)
from companion.plan.run import run_plan

SMALL = functools.partial(GPT, 96, 32, 48, 4, 4)     # vocab, seq_len, width, depth, heads


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is as fast, and on a loaded 2-core machine two OpenMP threads
    that wait for each other make every operator many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain_losses():
    """Three steps of the plain run (no budget): what every exact plan must reproduce."""
    return run_plan(SMALL, Candidate(12), 12, 3, lr=1e-3)


def _real_peak(model_fn, cand: Candidate, steps: int = 2) -> int:
    """Peak of `steps` real steps, built inside the tracked block as `simulate` builds them, the
    data made before it (`run_plan` measures so)."""
    return run_plan(model_fn, cand, cand.micro_batch * cand.accumulation, steps).peak


@pytest.mark.parametrize("cand", [
    Candidate(2, 3), Candidate(6, 1, 2, "autocast"), Candidate(6, lora_rank=4),
    Candidate(3, 2, 2, "mixed", offload=True)], ids=lambda c: c.describe())
def test_a_simulated_step_needs_what_the_real_one_does(cand):
    fake = simulate(SMALL, cand).peak
    real = _real_peak(SMALL, cand)
    assert abs(fake - real) <= 8                  # the real loop's one-value loss total


def test_fused_attention_is_simulated_too():
    fn = functools.partial(SMALL, fused_attention=True)
    cand = Candidate(3, 2, 2, "autocast")
    assert abs(simulate(fn, cand).peak - _real_peak(fn, cand)) <= 8


@pytest.mark.parametrize("cand, fused", [
    (Candidate(6), False), (Candidate(2, 3, 2), True), (Candidate(6, 1, 4, "autocast"), False),
    (Candidate(3, 2, 1, "mixed"), True), (Candidate(2, 3, offload=True), False),
    (Candidate(6, 1, 2, lora_rank=4), True)], ids=lambda c: getattr(c, "describe", str)())
def test_predictions_follow_the_simulation(cand, fused):
    fn = functools.partial(SMALL, fused_attention=fused)
    predicted = predict_memory(GPTShape.of(fn), cand).peak
    assert abs(predicted - simulate(fn, cand).peak) <= 0.06 * predicted


def test_a_simulated_1b_parameter_step_is_within_5_percent_of_the_prediction():
    fn = functools.partial(GPT, 50257, 1024, 2048, 16, 16, fused_attention=True)
    shape = GPTShape.of(fn)
    assert shape.n_params == estimate.gpt_params(50257, 1024, 2048, 16) > 10**9
    cand = Candidate(2, 4, 4, "autocast")          # accumulation, checkpointing, bf16 compute
    simulated = simulate(fn, cand).peak
    predicted = predict_memory(shape, cand).peak
    assert simulated > 10 * 2**30 and abs(predicted - simulated) <= 0.05 * simulated


@pytest.mark.parametrize("budget", ["6 MiB", "3 MiB", "1200 KiB"])
def test_the_chosen_plan_trains_under_the_budget_and_learns_the_same(budget, plain_losses):
    p = plan(SMALL, 12, budget=budget, device="cpu", allow=EXACT[:2] + ("offload",),
             simulate_plain=False)
    assert p.chosen_row.simulated <= p.usable
    report = p.run(3)                              # raises OutOfMemoryError if it does not fit
    assert report.peak <= p.budget < plain_losses.peak       # the plain run would not fit
    torch.testing.assert_close(report.losses, plain_losses.losses, rtol=1e-5, atol=1e-6)


def test_nothing_fits_says_by_how_much_and_what_to_allow():
    with pytest.raises(NothingFits, match=r"closest needs .* over, \d+% too much"
                                          r".*allow offload"):
        plan(SMALL, 12, budget="100 KiB", device="cpu", allow=("accumulation", "checkpointing"))
    with pytest.raises(NothingFits, match="host budget"):
        plan(SMALL, 12, budget="1 MiB", device="cpu", host_budget="1 KiB")


def test_lora_is_chosen_only_when_allowed_and_fits_where_nothing_else_does():
    shape = GPTShape.of(SMALL)                     # no host memory to offload to:
    smallest = {lora: min(predict_memory(shape, c).peak for c in candidates(
        shape, 12, allow=EXACT + (("lora",) if lora else ()), lora_rank=2) if not c.offload)
        for lora in (0, 1)}
    budget = (smallest[0] + smallest[1]) // 2
    with pytest.raises(NothingFits, match="allow lora"):
        plan(SMALL, 12, budget=budget, device="cpu", host_budget=0)
    p = plan(SMALL, 12, budget=budget, device="cpu", allow=EXACT + ("lora",), lora_rank=2,
             host_budget=0, simulate_plain=False)
    assert p.chosen.lora_rank == 2 and p.run(2).peak <= p.budget


def test_the_table_shows_the_plain_run_and_the_choice_explained():
    p = plan(SMALL, 12, budget="3 MiB", device="cpu")
    text = str(p)
    assert "plain (no technique)" in text and "->" in text and "Chosen: " in text
    assert p.plain.simulated > p.budget >= p.chosen_row.simulated
    assert set(p.bars()) == {"plain run (predicted)", "chosen plan (predicted)"}


def test_cost_model_ranks_what_each_lever_costs():
    shape = GPTShape.of(SMALL)
    gpu, cpu = CostModel.for_device("cuda"), CostModel.for_device("cpu")
    t = lambda c, cost=gpu: predict_seconds(shape, c, cost)["total"]
    assert t(Candidate(6, 1, 2)) > t(Candidate(6))                 # recompute
    assert t(Candidate(1, 6)) > t(Candidate(6))                    # more launches
    assert t(Candidate(6, offload=True)) > t(Candidate(6))         # copies over the link
    assert t(Candidate(6, precision="autocast")) < t(Candidate(6))            # tensor cores
    assert t(Candidate(6, precision="autocast"), cpu) == t(Candidate(6), cpu)  # CPUs differ


def test_candidates_keep_the_effective_batch_and_check_their_arguments():
    shape = GPTShape.of(SMALL)
    for c in candidates(shape, 12, world_size=2, allow=EXACT):
        assert c.micro_batch * c.accumulation == 6 and not c.offload and c.precision != "mixed"
    assert {c.zero_stage for c in candidates(shape, 12, world_size=2)} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="unknown technique"):
        candidates(shape, 12, allow=["accumulate"])
    with pytest.raises(ValueError, match="split evenly"):
        candidates(shape, 12, world_size=5)
    with pytest.raises(ValueError, match="lora_rank"):
        candidates(shape, 12, allow=["lora"], lora_rank=0)
    with pytest.raises(TypeError, match="companion.models.GPT"):
        GPTShape.of(lambda **factory: torch.nn.Linear(3, 3, **factory))


def test_several_ranks_are_simulated_and_run_on_gloo():
    fn = functools.partial(GPT, 64, 16, 32, 2, 2)
    ddp = predict_memory(GPTShape.of(fn), Candidate(4), world_size=2).peak
    p = plan(fn, 8, budget=int(0.8 * ddp), device="cpu", world_size=2, simulate_plain=False)
    assert p.chosen.zero_stage > 0
    report = p.run(2)
    assert report.peak <= p.budget and len(report.losses) == 2
    plain = run_plan(fn, Candidate(8), 8, 2, lr=p.lr)
    torch.testing.assert_close(report.losses, plain.losses, rtol=1e-4, atol=1e-5)
    stage = ("ddp", "zero1", "zero2", "zero3")[p.chosen.zero_stage]   # depth 2: no segments
    assert train_command(p).startswith(     # between 1 and depth, nothing the launcher lacks
        f"torchrun --nproc_per_node=2 -m companion train --parallel {stage} ")


def test_the_explorer_shows_the_plan_for_each_budget_and_why_nothing_fits():
    from companion.widgets.plan import budget_view, draw_plan_bars
    roomy, tight = budget_view(SMALL, 12, 6 * 2**20), budget_view(SMALL, 12, 1200 * 2**10)
    assert roomy["fits"] and tight["fits"] and set(roomy["bars"]) >= {"plain run", "chosen plan"}
    peak = lambda view: sum(view["bars"]["chosen plan"].values())
    assert peak(tight) <= 1200 * 2**10 < peak(roomy) <= 6 * 2**20 < sum(
        roomy["bars"]["plain run"].values())
    assert "optimizer offload" in tight["summary"]
    nothing = budget_view(SMALL, 12, 10 * 2**10)
    assert not nothing["fits"] and "the closest needs" in nothing["summary"]
    assert len(draw_plan_bars(tight).patches) >= 3


@pytest.mark.parametrize("gb", [None, 16, 24, 40, 80])
def test_the_capstone_does_not_fit_its_budget_and_no_single_lever_makes_it(gb):
    from companion.device import sizes, sizes_for_memory
    s = sizes("cpu") if gb is None else sizes_for_memory(gb * 10**9)
    fn = functools.partial(GPT, s.vocab, s.seq_len, s.cap_width, s.cap_depth, s.gpt_heads,
                           fused_attention=True)
    shape, device_type = GPTShape.of(fn), "cpu" if gb is None else "cuda"
    fits = [c for c in candidates(shape, s.cap_batch, allow=EXACT + LOW_PRECISION)
            if predict_memory(shape, c, device_type=device_type).peak <= s.cap_budget]
    assert fits and all(len(c.techniques()) >= 2 for c in fits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_capstone_plan_trains_under_its_budget_with_the_plain_losses():
    from companion.device import sizes
    s = sizes("cuda")
    fn = functools.partial(GPT, s.vocab, s.seq_len, s.cap_width, s.cap_depth, s.gpt_heads,
                           fused_attention=True)
    p = plan(fn, s.cap_batch, budget=s.cap_budget, device="cuda", lr=3e-3)
    report = p.run(4)                         # under set_per_process_memory_fraction
    assert report.peak <= p.budget
    plain = run_plan(fn, Candidate(s.cap_batch), s.cap_batch, 4, device="cuda", lr=3e-3)
    assert plain.peak > p.budget
    torch.testing.assert_close(report.losses, plain.losses, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad, error, match", [
    (lambda: plan(SMALL, 12, budget=0, device="cpu"), ValueError, "positive size"),
    (lambda: plan(SMALL, 12, budget="1 MiB", device="cpu", verify=-1), ValueError, "verify"),
    (lambda: plan(SMALL, 12, budget="1 MiB", device="cpu", allow="offloading"), ValueError,
     r"unknown technique\(s\) \['offloading'\]"),
    (lambda: run_plan(SMALL, Candidate(12), 12, 0), ValueError, "steps must be a positive"),
    (lambda: run_plan(SMALL, Candidate(12), 12, -1), ValueError, "steps must be a positive"),
    (lambda: Candidate(4, precision="fp16"), ValueError, "precision must be one of"),
    (lambda: Candidate(0), ValueError, "micro_batch must be an int of at least 1"),
    (lambda: predict_memory(GPTShape.of(SMALL), Candidate(12, segments=5)), ValueError,
     "5 checkpoint segments for a model of 4 blocks"),
    (lambda: GPTShape.of(SMALL()), TypeError, "model_fn is a GPT, not a function"),
    (lambda: GPTShape.of(None), TypeError, "not a function that builds the model"),
    (lambda: GPTShape.of(lambda **factory: 1 / 0), TypeError, "raised ZeroDivisionError"),
], ids=["budget 0", "verify -1", "unknown allow", "run 0", "run -1", "precision", "micro 0",
        "segments > depth", "a GPT", "None", "raises"])
def test_bad_input_says_what_to_pass(bad, error, match):
    with pytest.raises(error, match=match):
        bad()


def test_one_technique_may_be_named_alone_and_nothing_fits_hints_only_what_was_searched():
    p = plan(SMALL, 12, budget="100 MiB", device="cpu", allow="checkpointing", verify=0)
    assert p.chosen.accumulation == 1                      # not split into letters
    fn = functools.partial(GPT, 64, 16, 32, 2, 2)
    with pytest.raises(NothingFits) as nothing:
        plan(fn, 8, budget="10 KiB", device="cpu", world_size=2)
    assert "offload" not in str(nothing.value) and "lora" not in str(nothing.value)


def test_fake_addresses_restore_exactly_what_was_there():
    from torch._subclasses.fake_tensor import FakeTensor

    from companion.plan.simulation import _fake_addresses
    before = (torch.UntypedStorage.data_ptr, FakeTensor.data_ptr,
              "data_ptr" in vars(torch.UntypedStorage), "data_ptr" in vars(FakeTensor))
    with _fake_addresses():
        assert torch.UntypedStorage.data_ptr is not before[0]
    assert before == (torch.UntypedStorage.data_ptr, FakeTensor.data_ptr,
                      "data_ptr" in vars(torch.UntypedStorage), "data_ptr" in vars(FakeTensor))
