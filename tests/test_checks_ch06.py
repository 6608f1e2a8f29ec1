"""Chapter 06 checks pass on the references and fail, with a CheckFailed, on known-wrong answers.

The answers below live at module level, so the gloo workers can import them by name.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as imported_all_reduce

from companion import collectives
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


class Averager:
    """The exercise's answer: a flat buffer per bucket, filled by the hooks, launched in order."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.flat = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
        self.where = {}
        for i, bucket in enumerate(buckets):
            offset = 0
            for p in bucket:
                self.where[p] = (i, offset)
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self.hook)
        self.ready, self.works, self.next = [0] * len(buckets), [], 0

    def hook(self, param):
        i, offset = self.where[param]
        self.flat[i][offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        self.ready[i] += 1
        self.launch_ready()

    def launch_ready(self):
        while self.next < len(self.buckets) and \
                self.ready[self.next] == len(self.buckets[self.next]):
            self.works.append(dist.all_reduce(self.flat[self.next], async_op=True))
            self.next += 1

    averages = True          # AveragerSums leaves the sums

    def finish(self):
        for work in self.works:
            work.wait()
        divisor = dist.get_world_size() if self.averages else 1
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for p in bucket:
                p.grad.copy_(self.flat[i][offset:offset + p.numel()].view_as(p) / divisor)
                offset += p.numel()
        self.ready, self.works, self.next = [0] * len(self.buckets), [], 0


class AveragerSums(Averager):
    averages = False


class AveragerBlocking(Averager):
    def launch_ready(self):
        while self.next < len(self.buckets) and \
                self.ready[self.next] == len(self.buckets[self.next]):
            dist.all_reduce(self.flat[self.next])
            self.next += 1


class AveragerAfterBackward(Averager):
    def hook(self, param):
        i, offset = self.where[param]
        self.flat[i][offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        self.ready[i] += 1

    def finish(self):
        self.launch_ready()
        super().finish()


class AveragerNeverResets(Averager):
    def finish(self):
        ready = self.ready
        super().finish()
        self.ready = ready


class AveragerPerParameter(Averager):
    def hook(self, param):
        super().hook(param)
        self.works.append(dist.all_reduce(param.grad, async_op=True))


class AveragerLeavesGrads(Averager):
    def finish(self):
        for work in self.works:
            work.wait()
        self.ready, self.works, self.next = [0] * len(self.buckets), [], 0


class AveragerFromImport(Averager):
    """Right: the same answer, calling all_reduce imported by name from torch.distributed."""

    def launch_ready(self):
        while self.next < len(self.buckets) and \
                self.ready[self.next] == len(self.buckets[self.next]):
            self.works.append(imported_all_reduce(self.flat[self.next], async_op=True))
            self.next += 1


class AveragerWaitsInHook(Averager):
    """Wrong: asynchronous in name only, it waits for each all-reduce inside the hook."""

    def launch_ready(self):
        started = len(self.works)
        super().launch_ready()
        for work in self.works[started:]:
            work.wait()


class AveragerLaunchesAtLastHook(Averager):
    """Wrong: holds every bucket back until the last gradient is in, then launches them all."""

    def hook(self, param):
        i, offset = self.where[param]
        self.flat[i][offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        self.ready[i] += 1
        if sum(self.ready) == sum(len(b) for b in self.buckets):
            self.launch_ready()


def test_late_launch_finds_the_first_bucket_held_back():
    grads = [("grad", 0)] * 3 + [("grad", 1)] + [("grad", 2)] * 2
    launches = [("launch", i, True, True) for i in range(3)]
    on_time = grads[:3] + launches[:1] + grads[3:4] + launches[1:2] + grads[4:] + launches[2:]
    assert ch06._late_launch(on_time, [3, 1, 2]) is None
    assert ch06._late_launch(grads + launches, [3, 1, 2]) == 0
    late_middle = grads[:3] + launches[:1] + grads[3:4] + grads[4:] + launches[1:]
    assert ch06._late_launch(late_middle, [3, 1, 2]) == 1
    swapped = [("grad", 0), ("grad", 0), ("grad", 1), ("grad", 0)] + launches[:2] + grads[4:] \
        + launches[2:]                         # bucket 1's gradient first: both launch together
    assert ch06._late_launch(swapped, [3, 1, 2]) is None


def test_references_pass(capsys):
    ch06.check_ring_all_reduce(collectives.ring_all_reduce)
    ch06.check_bucketed_hooks(Averager)
    ch06.check_bucketed_hooks(AveragerFromImport)
    out = capsys.readouterr().out
    assert out.count("passed") == 3 and "while backward was still running" in out


@pytest.mark.parametrize("check, answer, words", [
    (ch06.check_ring_all_reduce, ring_wrong_chunk, "wrong slot"),
    (ch06.check_ring_all_reduce, ring_with_all_reduce, "all_reduce"),
    (ch06.check_ring_all_reduce, collectives.naive_all_reduce, "naive"),
    (ch06.check_ring_all_reduce, ring_returns_a_copy, "unchanged"),
    (ch06.check_bucketed_hooks, AveragerSums, "divide by the world size"),
    (ch06.check_bucketed_hooks, AveragerBlocking, "async_op=True"),
    (ch06.check_bucketed_hooks, AveragerAfterBackward, "launch it from the hook"),
    (ch06.check_bucketed_hooks, AveragerNeverResets, "reset what you count"),
    (ch06.check_bucketed_hooks, AveragerPerParameter, "once, when its last gradient is in"),
    (ch06.check_bucketed_hooks, AveragerLeavesGrads, "copy the averaged bucket back"),
    (ch06.check_bucketed_hooks, AveragerWaitsInHook, "work.wait() ran while backward"),
    (ch06.check_bucketed_hooks, AveragerLaunchesAtLastHook, "overlaps nothing with backward"),
], ids=lambda v: getattr(v, "__name__", None))
def test_checks_fail_on_known_wrong_answers_with_their_hint(check, answer, words):
    with pytest.raises(CheckFailed) as info:
        check(answer)
    assert words in str(info.value)


@pytest.mark.parametrize("check", [ch06.check_ring_all_reduce, ch06.check_bucketed_hooks])
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


def test_all_reduce_imported_by_name_before_the_check_is_watched_too():
    import sys
    import types

    real = dist.all_reduce
    module = types.ModuleType("early_answer")     # imported before the patch, as a worker does
    module.all_reduce = real                       # with the parent's __main__
    exec("class Answer:\n    pass", vars(module))
    sys.modules["early_answer"] = module
    try:
        with ch06._watched_all_reduce([], [], []) as adopt:
            adopt(module.Answer)
            assert module.all_reduce is dist.all_reduce and module.all_reduce is not real
        assert module.all_reduce is real and dist.all_reduce is real       # restored
    finally:
        del sys.modules["early_answer"]
