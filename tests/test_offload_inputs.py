"""companion.checkpointing.offload_inputs: checkpoint inputs on the host (the same outputs and
gradients as the plain layers, moved, fetched back one ahead), where the step's peak is
(measured to the byte against its prediction, in the regime where offload leaves the peak as it
was and in the one where it lowers it), and when the copies hide behind compute."""
import pytest
import torch

from companion.checkpointing import offload_inputs
from companion.checkpointing.offload_inputs import (MODES, InputOffload, checkpoint_offloaded,
                                                    transfer_hides, where_is_the_peak)
from companion.memory import track
from companion.models import GPT
from companion.plan.costmodel import CostModel

pytestmark = pytest.mark.usefixtures("one_thread")


def _gpt(depth, tokens, width, *, attention="sdpa", batch=2, seed=0):
    """A GPT's blocks, an input for them (its embeddings) and its head and loss as a module."""
    model = GPT(32, tokens, width, depth, 4, seed=seed, attention=attention)
    idx = torch.randint(0, 32, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        x = model.tok(idx) + model.pos(torch.arange(tokens))             # (B, T, C)
    return list(model.blocks), x, _Head(model)


class _Head(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.ln, self.head = model.ln, model.head

    def forward(self, h):
        return self.head(self.ln(h)).square().mean()


def _grads(layers, head, x, run):
    for m in (*layers, head):
        if isinstance(m, torch.nn.Module):
            m.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_()
    out = run(layers, leaf)
    head(out).backward()
    return [out.detach(), leaf.grad] + [p.grad for layer in layers for p in layer.parameters()]


def _plain(layers, x):
    for layer in layers:
        x = layer(x)
    return x


# ---------------------------------------------------------------- the same numbers


@pytest.mark.parametrize("attention", ["sdpa", "written"])
@pytest.mark.parametrize("offload", [True, False])
def test_outputs_and_gradients_equal_the_plain_layers(attention, offload):
    layers, x, head = _gpt(3, 16, 32, attention=attention)
    want = _grads(layers, head, x, _plain)
    got = _grads(layers, head, x, lambda ls, h: checkpoint_offloaded(ls, h, offload=offload))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_dropout_masks_are_replayed_in_the_recompute():
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5))
              for _ in range(3)]
    x, head = torch.randn(8, 16), torch.nn.Linear(16, 1)
    torch.manual_seed(1)
    want = _grads(layers, lambda h: head(h).sum(), x, _plain)
    torch.manual_seed(1)
    got = _grads(layers, lambda h: head(h).sum(), x, checkpoint_offloaded)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


class _WrongInput(InputOffload):
    """Known-wrong: hands back the input saved before the one asked for."""

    def _unpack(self, i):
        return super()._unpack(max(i - 1, 0))


def test_a_wrong_input_fetched_back_gives_other_gradients():
    layers, x, head = _gpt(3, 16, 32)
    want = _grads(layers, head, x, _plain)
    got = _grads(layers, head, x,
                 lambda ls, h: checkpoint_offloaded(ls, h, offload=_WrongInput()))
    with pytest.raises(AssertionError):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)


def test_a_second_backward_with_retain_graph_finds_the_inputs_on_the_host():
    layers, x, head = _gpt(3, 16, 32)
    leaf = x.detach().clone().requires_grad_()
    loss = head(checkpoint_offloaded(layers, leaf))
    loss.backward(retain_graph=True)
    first = leaf.grad.clone()
    leaf.grad = None
    loss.backward()
    torch.testing.assert_close(leaf.grad, first)


# ---------------------------------------------------------------- moved, fetched back one ahead


class _Spy(torch.nn.Module):
    """Runs `layer`; in its recompute (inside backward) notes which inputs wait on the device."""

    def __init__(self, layer, k, hooks, seen):
        super().__init__()
        self.layer, self.k, self.hooks, self.seen = layer, k, hooks, seen

    def forward(self, x):
        if torch._C._current_graph_task_id() != -1:               # backward: the recompute
            self.seen[self.k] = sorted(self.hooks.fetched)
        return self.layer(x)


class _FetchesAll(InputOffload):
    """Known-wrong: the first unpack fetches every input (no double buffer: all back at once)."""

    def _unpack(self, i):
        for j in range(i):
            if j not in self.fetched:
                self._fetch(j)
        return super()._unpack(i)


class _NeverFetched(InputOffload):
    """Known-wrong: hands back the host copy itself (on CUDA: a tensor on the wrong device)."""

    def _fetch(self, i):
        self.fetched[i] = self.host[i][1], None
        self.bytes_to_device += self.host[i][1].numel() * self.host[i][1].element_size()


class _NotMoved(InputOffload):
    """Known-wrong: keeps the device tensor itself, no host copy."""

    def _pack(self, t):
        self.host.append((t.device, t))
        self.bytes_to_host += t.numel() * t.element_size()
        return len(self.host) - 1


def _fetched_during_recompute(hooks_cls, **options):
    layers, x, head = _gpt(4, 16, 32)
    hooks, seen = hooks_cls(**options), {}
    spies = [_Spy(layer, k, hooks, seen) for k, layer in enumerate(layers)]
    head(checkpoint_offloaded(spies, x.clone().requires_grad_(), offload=hooks)).backward()
    return hooks, seen


def test_the_next_input_is_fetched_while_this_layer_recomputes():
    hooks, seen = _fetched_during_recompute(InputOffload)
    assert seen == {3: [2], 2: [1], 1: [0], 0: []}                # two buffers: own + next
    nbytes = 2 * 16 * 32 * 4                                       # (B, T, C) fp32
    assert (hooks.bytes_to_host, hooks.bytes_to_device, hooks.prefetched) == \
        (4 * nbytes, 4 * nbytes, 3)


@pytest.mark.parametrize("hooks_cls, options", [(InputOffload, {"prefetch": False}),
                                                (_FetchesAll, {})])
def test_no_prefetch_and_fetching_all_at_once_are_seen(hooks_cls, options):
    hooks, seen = _fetched_during_recompute(hooks_cls, **options)
    assert seen != {3: [2], 2: [1], 1: [0], 0: []}


def test_on_the_cpu_the_inputs_are_counted_on_the_host():
    layers, x, _ = _gpt(4, 16, 32)
    leaf = x.clone().requires_grad_()
    held = {}
    for offload in (False, True):
        with track("cpu") as t:
            out = checkpoint_offloaded(layers, leaf.clone(), offload=offload)
            held[offload] = (t.current, t.host_current)
        del out
    nbytes = 2 * 16 * 32 * 4
    # the four inputs leave the device (the first is the clone, the others layer outputs)
    assert held[False][0] - held[True][0] == 4 * nbytes
    assert (held[False][1], held[True][1]) == (0, 4 * nbytes)


# ---------------------------------------------------------------- where the peak is


def _exact(rows):
    """Every figure of every mode equal to its prediction, and the inputs' bytes on the host."""
    return all(r.after_forward == r.predicted_after_forward and r.peak == r.predicted_peak
               for r in rows.values()) and rows["offload"].host_after_forward > 0


def test_few_tokens_the_peak_is_backwards_end_and_offload_leaves_it():
    # A block's gradients, (12·64² + 13·64)·4 B = 200 KB, outweigh its input, 2·32·64·4 B = 16 KB:
    # the peak is the first layer's backward, where checkpointing too holds one input.
    layers, x, head = _gpt(4, 32, 64)
    rows = where_is_the_peak(layers, x, head)
    assert set(rows) == set(MODES) and _exact(rows)
    ckpt, off, nbytes = rows["checkpoint"], rows["offload"], 2 * 32 * 64 * 4
    assert ckpt.after_forward - off.after_forward == 4 * nbytes == off.host_after_forward
    assert (ckpt.where, off.where, ckpt.inputs_at_peak, off.inputs_at_peak) == \
        ("layer 0", "layer 0", 1, 1)
    assert off.peak == ckpt.peak < rows["plain"].peak


def test_many_tokens_the_inputs_set_the_peak_and_offload_lowers_it():
    # 2·256 tokens of width 16: an input, 32 KB, outweighs a block's gradients, 13 KB.
    layers, x, head = _gpt(8, 256, 16)
    rows = where_is_the_peak(layers, x, head)
    assert _exact(rows)
    ckpt, off = rows["checkpoint"], rows["offload"]
    assert (ckpt.where, ckpt.inputs_at_peak, off.inputs_at_peak) == ("layer 7", 8, 2)
    assert off.peak < ckpt.peak


def test_where_is_the_peak_puts_the_gradients_back():
    layers, x, head = _gpt(2, 16, 32)
    before = torch.ones_like(head.head.weight)
    head.head.weight.grad = before
    where_is_the_peak(layers, x, head)
    assert head.head.weight.grad is before and layers[0].qkv.weight.grad is None


@pytest.mark.parametrize("hooks_cls", [_NotMoved, _NeverFetched, _FetchesAll])
def test_known_wrong_offloads_miss_the_prediction(monkeypatch, hooks_cls):
    layers, x, head = _gpt(8, 256, 16)
    assert _exact(where_is_the_peak(layers, x, head))
    monkeypatch.setattr(offload_inputs, "InputOffload", hooks_cls)
    assert not _exact(where_is_the_peak(layers, x, head))


# ---------------------------------------------------------------- when the copies hide


def test_transfer_time_against_the_layers_compute():
    layer, x = torch.nn.Linear(64, 32), torch.randn(128, 64)          # 2·128·64·32 FLOPs
    slow = CostModel(1e9, 1.0, 3e-3, 1e9, 1e9, 1e9, activation_bandwidth=1e6)
    o = transfer_hides(layer, x, cost=slow)
    forward = 2 * 128 * 64 * 32 / 1e9 + 1e-3
    assert o.nbytes == 128 * 64 * 4 and o.copy_seconds == pytest.approx(o.nbytes / 1e6)
    assert (o.forward_seconds, o.backward_seconds) == (pytest.approx(forward),
                                                       pytest.approx(3 * forward))
    assert not o.hides                                               # 33 ms of copy, 2 ms
    fast = CostModel(1e9, 1.0, 3e-3, 1e9, 1e9, 1e9, activation_bandwidth=1e11)
    assert transfer_hides(layer, x, cost=fast).hides


def test_a_gpu_prices_the_copy_at_its_host_link_and_16_bits_at_half_speed():
    layer = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    gpu = CostModel.for_gpu("H100 SXM")
    o = transfer_hides(layer, x, cost=gpu)
    assert o.copy_seconds == pytest.approx(128 * 64 * 2 / gpu.host_bandwidth)
    flops = 2 * 128 * 64 * 64
    assert o.forward_seconds == pytest.approx(flops / (gpu.flops * gpu.half_speedup)
                                              + gpu.layer_seconds / 3)


def test_the_default_cost_is_the_cpus():
    layer, x = torch.nn.Linear(8, 8), torch.randn(4, 8)
    cpu = CostModel.for_device("cpu")
    assert transfer_hides(layer, x).copy_seconds == pytest.approx(4 * 8 * 4 /
                                                                   cpu.activation_bandwidth)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, error", [
    (lambda: checkpoint_offloaded([], torch.randn(2, 2)), ValueError),
    (lambda: checkpoint_offloaded([1, 2], torch.randn(2, 2)), ValueError),
    (lambda: checkpoint_offloaded([torch.nn.Identity()], [1.0]), TypeError),
    (lambda: checkpoint_offloaded([torch.nn.Identity()], torch.randn(2), offload="yes"),
     TypeError),
    (lambda: where_is_the_peak([torch.nn.Linear(2, 2)], torch.randn(3, 2), lambda h: h),
     ValueError),
    (lambda: where_is_the_peak([torch.nn.Linear(2, 2)], torch.ones(3, 2, dtype=torch.long),
                               lambda h: h.sum()), TypeError),
    (lambda: transfer_hides(torch.nn.Linear(2, 2), torch.randn(3, 2), cost="cpu"), TypeError),
])
def test_bad_input_gets_a_clear_error(call, error):
    with pytest.raises(error, match="must|is True"):
        call()


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_on_cuda_the_inputs_wait_in_pinned_memory_and_gradients_match():
    layers, x, head = _gpt(4, 64, 32)
    for m in (*layers, head):
        m.cuda()
    x = x.cuda()
    want = _grads(layers, head, x, _plain)
    hooks = InputOffload()
    got = _grads(layers, head, x, lambda ls, h: checkpoint_offloaded(ls, h, offload=hooks))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert all(host.is_pinned() for _, host in hooks.host) and hooks.stream is not None
    rows = where_is_the_peak(layers, x, head)
    assert rows["offload"].after_forward < rows["checkpoint"].after_forward
