"""Chapter 09's check passes on the notebook's solution (and on other plans that keep the
training), and fails on known-wrong answers, each with its hint."""
import contextlib
import pickle

import pytest
import torch

from companion import lora
from companion.checks import ch09
from companion.checks.core import CheckFailed, call, evaluate
from companion.checks.harness import Remote
from companion.offload import CPUOffloadOptimizer
from companion.plan import CheckpointedBlocks


@pytest.fixture(autouse=True)
def one_thread_and_few_steps(monkeypatch):
    """Tiny models: one thread is as fast on a loaded machine; 3 steps instead of the notebook's
    6 are enough to see every behaviour the check looks at."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setattr(ch09, "sizes", lambda device=None: _few_steps())
    yield
    torch.set_num_threads(threads)


def _few_steps():
    import dataclasses

    from companion.device import sizes
    return dataclasses.replace(sizes("cpu"), steps=2)        # 2 * steps = 4 steps


def _train(model_fn, batches, lr, *, k=4, segments=4, offload=True, step_every_micro=False,
           micro_only=False, sum_losses=False, adapters=0, report_last=False):
    """The notebook's solution (offload + k micro-batches + checkpointing), or a usual mistake."""
    model = model_fn(dtype=torch.float32, device="cpu")
    if adapters:
        lora.apply_lora(model, adapters, targets=["qkv", "proj", "fc", "out"])
    if segments > 1:
        model.blocks = CheckpointedBlocks(model.blocks, segments)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = CPUOffloadOptimizer(params, lr=lr) if offload else torch.optim.AdamW(params, lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
            if micro_only and i:
                break
            loss = model.loss(xb, yb)
            (loss if sum_losses or micro_only else loss / k).backward()
            total = loss.item() if report_last else total + loss.item() / (1 if sum_losses else k)
            if step_every_micro:
                opt.step()
                opt.zero_grad()
        if not step_every_micro:
            opt.step()
        losses.append(total)
    return losses


def train_within_budget(model_fn, batches, lr):
    return _train(model_fn, batches, lr)


def test_the_solution_passes_and_says_what_it_saved(capsys):
    ch09.check_train_within_budget(train_within_budget)
    out = capsys.readouterr().out
    assert "passed" in out and "under the 8.00 MiB budget" in out and "unconstrained run" in out


def test_another_plan_that_keeps_the_training_passes_too():
    accumulate_and_offload = lambda f, b, lr: _train(f, b, lr, k=8, segments=1)
    assert "under the" in evaluate("check_train_within_budget", accumulate_and_offload)


@pytest.mark.parametrize("wrong, match, hint", [
    (lambda f, b, lr: _train(f, b, lr, k=1, segments=1, offload=False),
     "went over the 8.00 MiB budget", "combine the levers"),
    (lambda f, b, lr: _train(f, b, lr, step_every_micro=True), "weights changed 15 times",
     "one optimizer step per batch"),
    (lambda f, b, lr: _train(f, b, lr, micro_only=True), r"saw \[4, 4, 4, 4\] sequences",
     "all 16 sequences"),
    (lambda f, b, lr: _train(f, b, lr, sum_losses=True), "about 4 times",
     "divide each by the number of micro-batches"),
    (lambda f, b, lr: _train(f, b, lr, offload=False, k=16, adapters=2),
     "parameters train", "freezing and LoRA"),
    (lambda f, b, lr: _train(f, b, lr)[:-1], "expected 4 losses", ""),
    (lambda f, b, lr: _train(f, b, lr, report_last=True), "drift from the unconstrained",
     "the mean over the whole batch"),
], ids=["plain", "step per micro-batch", "one micro-batch", "summed losses", "lora",
        "a loss missing", "last micro-batch's loss"])
def test_known_wrong_answers_fail_with_their_hint(wrong, match, hint):
    with pytest.raises(CheckFailed, match=match) as failed:
        evaluate("check_train_within_budget", wrong)
    assert hint in failed.value.hint


class _Elsewhere(Remote):
    """An answer in another process, as under the grader: what crosses is pickled."""

    def __init__(self, fn):
        super().__init__(fn.__name__)
        self.fn = fn

    def call(self, args, kwargs):
        args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
        return pickle.loads(pickle.dumps(call(self.fn, *args, **kwargs)))

    def run_harness(self, fn, args, kwargs):
        args = [self.fn if a is self else a for a in args]
        return pickle.loads(pickle.dumps(fn(*args, **kwargs)))

    def limit(self, seconds):
        return contextlib.nullcontext()


def test_the_check_runs_the_answer_where_it_lives_and_judges_it_here():
    assert "under the" in evaluate("check_train_within_budget", _Elsewhere(train_within_budget))
