"""Chapter 09's check passes on the notebook's solution (and on other plans that keep the
training), and fails on known-wrong answers, each with its hint."""
import threading

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from companion import lora
from companion.checks import ch09
from companion.checks.core import CheckFailed, evaluate
from companion.memory import on_host
from companion.offload import CPUOffloadOptimizer
from companion.plan import CheckpointedBlocks
from elsewhere import Elsewhere


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
           micro_only=False, sum_losses=False, adapters=0, report_last=False, dtype=torch.float32,
           autocast=False, optimizer=torch.optim.AdamW, keep=lambda name: True, skip_last=False,
           backward_scale=None, as_numpy=False, **options):
    """The notebook's solution (offload + k micro-batches + checkpointing), or a usual mistake."""
    model = model_fn(dtype=dtype, device="cpu")
    if adapters:
        lora.apply_lora(model, adapters, targets=["qkv", "proj", "fc", "out"])
    if segments > 1:
        model.blocks = CheckpointedBlocks(model.blocks, segments)
    params = [p for n, p in model.named_parameters() if p.requires_grad and keep(n)]
    opt = (CPUOffloadOptimizer(params, optimizer, lr=lr, **options) if offload
           else optimizer(params, lr=lr, **options))
    losses = []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        total = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k))):
            if micro_only and i:
                break
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model.loss(xb, yb).float()
            scale = backward_scale or (1 if sum_losses or micro_only else 1 / k)
            (loss * scale).backward()
            total = loss.item() if report_last else total + loss.item() / (1 if sum_losses else k)
            if step_every_micro:
                opt.step()
                opt.zero_grad()
        if not step_every_micro and not (skip_last and step == len(batches) - 1):
            opt.step()
        losses.append(numpy.float32(total) if as_numpy else total)
    return losses


def _plain(model_fn, batches, lr):
    """Plain full-batch training: over the budget, unless the budget does not see it."""
    model = model_fn(dtype=torch.float32, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for x, y in batches:
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _on_host(model_fn, batches, lr):
    with on_host():
        return _plain(model_fn, batches, lr)


def _in_a_thread(model_fn, batches, lr):
    out = []
    worker = threading.Thread(target=lambda: out.extend(_plain(model_fn, batches, lr)))
    worker.start()
    worker.join()
    return out


def _modes_off(model_fn, batches, lr):
    with _disable_current_modes():
        return _plain(model_fn, batches, lr)


def _whole_model_checkpointed(model_fn, batches, lr, k=8):
    """torch.utils.checkpoint around the whole GPT: the recompute runs its forward again."""
    model = model_fn(dtype=torch.float32, device="cpu")
    opt = CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=lr)
    out = []
    for x, y in batches:
        opt.zero_grad()
        total = 0.0
        for xb, yb in zip(x.chunk(k), y.chunk(k)):
            logits = checkpoint(model, xb, use_reentrant=False)
            loss = F.cross_entropy(logits.flatten(0, 1), yb.flatten()) / k
            del logits
            loss.backward()
            total += loss.item()
        opt.step()
        out.append(total)
    return out


def train_within_budget(model_fn, batches, lr):
    return _train(model_fn, batches, lr)


def test_the_solution_passes_and_says_what_it_saved(capsys):
    ch09.check_train_within_budget(train_within_budget)
    out = capsys.readouterr().out
    assert "passed" in out and "under the 8.00 MiB budget" in out and "unconstrained run" in out


@pytest.mark.parametrize("legit", [
    lambda f, b, lr: _train(f, b, lr, k=8, segments=1),
    _whole_model_checkpointed,
    lambda f, b, lr: _train(f, b, lr, autocast=True),
    lambda f, b, lr: _train(f, b, lr, dtype=torch.bfloat16),
    lambda f, b, lr: _train(f, b, lr, as_numpy=True),
], ids=["accumulate and offload", "whole model checkpointed", "bf16 autocast",
        "bf16 weights, fp32 masters on the host", "numpy floats"])
def test_other_plans_that_keep_the_training_pass_too(legit):
    assert "under the" in evaluate("check_train_within_budget", legit)


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
    (_on_host, "less than the model's own weights", "no on_host()"),
    (_in_a_thread, "less than the model's own weights", "no threads"),
    (_modes_off, "less than the model's own weights", "memory tracking"),
    (lambda f, b, lr: _train(f, b, lr, skip_last=True), r"moved 0\.8\d times as far",
     "the last one too"),
    (lambda f, b, lr: _train(f, b, lr, skip_last=True, dtype=torch.bfloat16),
     r"moved 0\.9\d times as far", "the last one too"),
    (lambda f, b, lr: _train(f, b, lr, optimizer=torch.optim.Adam), "drift", "AdamW with lr"),
    (lambda f, b, lr: _train(f, b, lr, weight_decay=0.0), "drift", "default options"),
    (lambda f, b, lr: _train(f, b, lr, keep=lambda n: not n.startswith("pos")),
     r"never changed: \['pos.weight'\]", "every parameter"),
    (lambda f, b, lr: _train(f, b, lr, backward_scale=1.0), "gradients are 4.00 times",
     "before backward"),
    (lambda f, b, lr: [float("nan")] * len(b), "not finite", "diverged"),
    (lambda f, b, lr: _train(f, b, lr / 2, autocast=True), r"moved 0\.50 times as far",
     "AdamW with lr"),
    (lambda f, b, lr: _train(f, b, lr / 2, dtype=torch.bfloat16), r"moved 0\.7\d times as far",
     "AdamW with lr"),
    (lambda f, b, lr: _train(f, b, lr, keep=lambda n: ".0.fc." not in n),
     r"never changed: \['blocks\.0\.fc\.weight', 'blocks\.0\.fc\.bias'\]",
     "every parameter"),
], ids=["plain", "step per micro-batch", "one micro-batch", "summed losses", "lora",
        "a loss missing", "last micro-batch's loss", "on_host", "thread", "modes disabled",
        "last step skipped", "bf16 weights, last step skipped", "Adam", "no weight decay",
        "pos left out", "no 1/k in backward", "NaN", "bf16 autocast, half the lr",
        "bf16 weights, half the lr", "a checkpointed block's layer left out"])
def test_known_wrong_answers_fail_with_their_hint(wrong, match, hint):
    with pytest.raises(CheckFailed, match=match) as failed:
        evaluate("check_train_within_budget", wrong)
    assert hint in failed.value.hint


def test_the_check_runs_the_answer_where_it_lives_and_judges_it_here():
    assert "under the" in evaluate("check_train_within_budget", Elsewhere(train_within_budget))
