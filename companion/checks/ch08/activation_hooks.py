"""Chapter 08, exercise 4: saved-tensor hooks that pack activations to the host and unpack
them back."""
from __future__ import annotations

import random

import torch

from companion.checkpointing import saved_for_backward
from companion.checks.ch08._common import _EXACT
from companion.checks.core import (CheckFailed, call, compare, exercise, fresh_seeds, harness,
                                   require)
from companion.memory import format_bytes, track
from companion.models import GPT, make_tokens
from companion.offload import offload_activations

__all__ = ["check_offload_hooks"]


def _gpt_case(seed: int):
    width, heads = random.Random(seed).choice([(24, 3), (40, 5), (36, 4)])
    model = GPT(29, 11, width, 2, heads, seed=seed)
    x, y = make_tokens(5, 11, vocab=29, seed=seed)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = [(s.nbytes, s.storage in weights) for s in saved_for_backward(model.loss, x, y)]
    sizes = sorted(n for n, is_weight in saved if not is_weight)
    return model, x, y, saved, sizes[len(sizes) // 2]      # min_bytes: half of them move


def _trip_tensors(seed: int, min_bytes: int) -> list[torch.Tensor]:
    """Three tensors of at least min_bytes that are not parameters: a strided view, a bf16 one,
    a leaf that does not require grad; then one that stays: a view of fewer than min_bytes bytes
    of a storage of more (as q is of a fused qkv's output)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(min_bytes // 24 + 1, 13, generator=g, requires_grad=True) * 2   # not a leaf
    fused = torch.randn(3, min_bytes // 4 + 1, generator=g, requires_grad=True) * 2
    return [base[:, 1::2], base.to(torch.bfloat16), base.detach().exp().T.contiguous(),
            fused[0, :min_bytes // 8]]


def _hooks_of(answer, min_bytes):
    hooks = call(answer, min_bytes)
    if not (isinstance(hooks, tuple) and len(hooks) == 2 and all(map(callable, hooks))):
        raise CheckFailed(f"expected a tuple (pack, unpack) of two functions, got {hooks!r:.80}",
                          hint="return pack, unpack  (the two functions, not their results).")
    return hooks


@harness
def _observe_hooks(answer, seed: int) -> dict:
    """Round trips of single tensors, then a GPT's forward and backward under the hooks."""
    model, x, y, _, min_bytes = _gpt_case(seed)
    pack, unpack = _hooks_of(answer, min_bytes)
    trips = []
    for t in _trip_tensors(seed, min_bytes):
        with track("cpu") as tr:
            packed = pack(t)
            host = tr.host_current
            back = unpack(packed)
            device = tr.current
        trips.append({"back": back, "host": host, "device": device,
                      "nbytes": t.numel() * t.element_size(),
                      "storage": t.untyped_storage().nbytes()})
    with track("cpu") as tr, torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model.loss(x, y)
        loss.backward()
    return {"trips": trips, "grads": [p.grad for p in model.parameters()],
            "host_peak": tr.host_peak, "peak": tr.peak, "min_bytes": min_bytes}


def _plain_and_reference(seed: int):
    model, x, y, saved, min_bytes = _gpt_case(seed)
    with track("cpu") as tr:
        model.loss(x, y).backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with track("cpu") as offloaded, offload_activations(min_bytes=min_bytes) as moved:
        model.loss(x, y).backward()
    wrong = {
        "leave parameters where they are: they stay on the device anyway, so copying them saves "
        "nothing (skip leaves that require grad, and views of them: t._base).":
            moved.bytes_to_host + sum(n for n, is_weight in saved if is_weight and n >= min_bytes),
        "move only tensors of at least min_bytes: small ones cost a transfer and save little.":
            sum(n for n, is_weight in saved if not is_weight),
    }
    return grads, moved.bytes_to_host, tr.peak, offloaded.peak, wrong, min_bytes


def _check_trip(trip: dict, expected: torch.Tensor, index: int, min_bytes: int) -> None:
    compare(trip["back"], expected, name=f"unpack(pack(t)) for test tensor {index}", **_EXACT,
            hint="unpack must give back exactly the tensor pack received: same values, dtype "
                 "and shape.")
    if trip["nbytes"] < min_bytes:                  # judged by _check_kept, after the GPT's run
        return
    require(trip["host"] == trip["nbytes"],
            f"pack put {trip['host']} bytes on the host for a {trip['nbytes']}-byte tensor",
            hint="pack must copy a large tensor to the host with offload.to_host(t) (t.clone() "
                 "stays on the device; returning t moves nothing).")
    require(trip["device"] == trip["nbytes"],
            f"unpack allocated {trip['device']} device bytes; it should bring back "
            f"{trip['nbytes']}",
            hint="unpack must copy the tensor back to its device: offload.to_device(host, "
                 "device) (the host copy is not on the device).")


def _check_kept(trip: dict, min_bytes: int) -> None:
    """A tensor of fewer than min_bytes bytes (a small view of a larger storage) stays: checked
    after the GPT's run, whose host bytes name the mistake of moving every tensor."""
    require(trip["host"] == 0 and trip["device"] == 0,
            f"pack put {trip['host']} bytes on the host (unpack {trip['device']} on the device) "
            f"for a view holding {trip['nbytes']} bytes, fewer than min_bytes = {min_bytes}, of "
            f"a storage of {trip['storage']} bytes",
            hint="a view holds only its own elements' bytes, however large the storage it "
                 "views: a small view of a large storage stays where it is.")


@exercise(points=2, timeout=20.0, reference="companion.offload.OffloadActivations")
def check_offload_hooks(answer) -> str:
    """answer(min_bytes) -> (pack, unpack): saved-tensor hooks that move every saved tensor of at
    least min_bytes that is not a parameter to the host, and bring it back to its device."""
    for seed in fresh_seeds(2):
        grads, moved, plain_peak, reference_peak, wrong, min_bytes = _plain_and_reference(seed)
        expected = _trip_tensors(seed, min_bytes)
        seen = _observe_hooks(answer, seed)
        for i, (trip, want) in enumerate(zip(seen["trips"], expected)):
            _check_trip(trip, want.detach(), i, min_bytes)
        # Each tensor's round trip is checked exactly above; the gradients are computed in two
        # processes under the grader (its own and the sandbox's), whose thread counts may sum in
        # another order: the last bits may differ, a wrong round trip (fp16, a stale tensor) is
        # off by far more.
        compare(seen["grads"], grads, name="gradients with your hooks", rtol=1e-5, atol=1e-8,
                hint="every unpacked tensor must equal the one packed, so gradients do not change.")
        compare(seen["host_peak"], moved, name="bytes your hooks kept on the host",
                hint="move each saved tensor that holds at least min_bytes and is not a "
                     "parameter: nothing more, nothing less.", known_wrong=wrong)
        for trip in seen["trips"]:
            if trip["nbytes"] < min_bytes:
                _check_kept(trip, min_bytes)
        require(seen["peak"] <= reference_peak + reference_peak // 50 + 1024,
                f"the device peak with your hooks is {format_bytes(seen['peak'])}; moving the "
                f"same tensors should bring it to {format_bytes(reference_peak)} (without hooks: "
                f"{format_bytes(plain_peak)})",
                hint="don't keep a reference to t in what pack returns (or anywhere else): the "
                     "device copy must be free to go once its host copy is made.")
    return (f"gradients unchanged; {format_bytes(moved)} of saved tensors wait on the host; "
            f"device peak {format_bytes(plain_peak)} -> {format_bytes(seen['peak'])}")
