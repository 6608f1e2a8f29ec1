"""Chapter 06 checks pass on the references and fail, with a CheckFailed, on known-wrong answers.

The answers below live at module level, so the gloo workers can import them by name.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist

from companion import collectives, ddp
from companion.checks import ch06
from companion.checks.core import CheckFailed, NotDone


def ring_wrong_chunk(tensor, group=None):
    """All-gather passes on the chunk it just received, not the one it finished: off by one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor.view(-1), world))
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world
        buffer = torch.empty_like(chunks[recv_i])
        _swap(chunks[send_i], right, buffer, left)
        chunks[recv_i] += buffer
    for step in range(world - 1):
        send_i, recv_i = (rank - step) % world, (rank - step - 1) % world   # should be +1
        _swap(chunks[send_i], right, chunks[recv_i], left)


def _swap(send, dst, recv, src):
    request = dist.isend(send, dst) if send.numel() else None
    if recv.numel():
        dist.recv(recv, src)
    if request is not None:
        request.wait()


def ring_with_all_reduce(tensor, group=None):
    dist.all_reduce(tensor)


def ring_returns_a_copy(tensor, group=None):
    result = tensor.clone()
    collectives.ring_all_reduce(result)
    return result


def ring_that_hangs(tensor, group=None):
    dist.recv(torch.empty_like(tensor), (dist.get_rank() - 1) % dist.get_world_size())


def ring_not_done(tensor, group=None):
    raise NotImplementedError("ring all-reduce: reduce-scatter then all-gather")


def average_sums(module, group=None):
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def average_nothing(module, group=None):
    pass


def average_forgets_frozen(module, group=None):
    for p in module.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def average_nan(module, group=None):
    ddp.average_gradients(module)
    for p in module.parameters():
        if p.grad is not None:
            p.grad.fill_(float("nan"))


def accumulate_without_no_sync(model, micro_batches, loss_fn, optimizer):
    for x, y in micro_batches:
        (loss_fn(model(x), y) / len(micro_batches)).backward()
        model.finish_gradient_synchronization()
    optimizer.step()


def accumulate_without_scaling(model, micro_batches, loss_fn, optimizer):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    optimizer.step()


def accumulate_without_finishing(model, micro_batches, loss_fn, optimizer):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def accumulate_never_syncing(model, micro_batches, loss_fn, optimizer):
    with model.no_sync():
        for x, y in micro_batches:
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def test_references_pass(capsys):
    ch06.check_ring_all_reduce(collectives.ring_all_reduce)
    ch06.check_ddp_average_gradients(ddp.average_gradients)
    ch06.check_no_sync_accumulation(ddp.accumulation_step)
    out = capsys.readouterr().out
    assert out.count("passed") == 3 and "instead of" in out


@pytest.mark.parametrize("check, answer, words", [
    (ch06.check_ring_all_reduce, ring_wrong_chunk, "wrong slot"),
    (ch06.check_ring_all_reduce, ring_with_all_reduce, "all_reduce"),
    (ch06.check_ring_all_reduce, collectives.naive_all_reduce, "naive"),
    (ch06.check_ring_all_reduce, ring_returns_a_copy, "unchanged"),
    (ch06.check_ddp_average_gradients, average_sums, "divide by the world size"),
    (ch06.check_ddp_average_gradients, average_nothing, "own gradient"),
    (ch06.check_ddp_average_gradients, average_forgets_frozen, "rank"),
    (ch06.check_ddp_average_gradients, average_nan, "NaN"),
    (ch06.check_no_sync_accumulation, accumulate_without_no_sync, "no_sync"),
    (ch06.check_no_sync_accumulation, accumulate_without_scaling, "divide each micro-batch's loss by k"),
    (ch06.check_no_sync_accumulation, accumulate_without_finishing, "finish_gradient_synchronization"),
    (ch06.check_no_sync_accumulation, accumulate_never_syncing, "never averaged"),
], ids=lambda v: getattr(v, "__name__", None))
def test_checks_fail_on_known_wrong_answers_with_their_hint(check, answer, words):
    with pytest.raises(CheckFailed) as info:
        check(answer)
    assert words in str(info.value)


@pytest.mark.parametrize("check", [ch06.check_ring_all_reduce, ch06.check_ddp_average_gradients,
                                   ch06.check_no_sync_accumulation])
@pytest.mark.parametrize("answer", [None, "ring_all_reduce", lambda *args: None])
def test_bad_answers_fail_cleanly_before_starting_workers(check, answer):
    with pytest.raises(CheckFailed):
        check(answer)


def test_a_hanging_answer_fails_within_the_worker_timeout():
    with pytest.raises(CheckFailed, match="did not finish"):
        ch06.check_ring_all_reduce(ring_that_hangs, worker_timeout=2)


def test_an_unfinished_exercise_reads_not_done():
    with pytest.raises(NotDone):
        ch06.check_ring_all_reduce.__wrapped__(ring_not_done)
