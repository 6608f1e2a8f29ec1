"""Checks for chapter 08, offload. The learner's hooks and step run inside `@harness` functions,
which return raw observations (tensors, byte counts); the verdicts are taken here."""
from __future__ import annotations

import random

import torch

from companion import estimate
from companion.checkpointing import saved_for_backward
from companion.checks.core import (CheckFailed, call, compare, exercise, fresh_seeds, harness,
                                   require)
from companion.memory import format_bytes, track
from companion.models import GPT, MLP, make_tokens
from companion.offload import offload_activations, to_host

__all__ = ["check_offloaded_step", "check_placement_arithmetic", "check_choose_offload",
           "check_offload_hooks"]

_EXACT = {"rtol": 0.0, "atol": 0.0}


# ---------------------------------------------------------------- exercise 1: the offloaded step

def _mlp_case(seed: int):
    d_in, width = random.Random(seed).choice([(7, 13), (11, 9), (5, 17)])
    model = MLP(d_in, width, 2, 3, seed=seed)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(6, d_in, generator=g), torch.randint(3, (6,), generator=g))
               for _ in range(3)]
    return model, batches


@harness
def _observe_step(answer, seed: int) -> list[dict]:
    model, batches = _mlp_case(seed)
    params = list(model.parameters())
    masters = [to_host(p.detach(), dtype=torch.float32) for p in params]
    host_grads = [to_host(torch.zeros_like(p)) for p in params]
    optimizer = torch.optim.AdamW(masters, lr=0.05, weight_decay=0.1, fused=True)
    seen = []
    for x, y in batches:
        model.loss(x, y).backward()
        storages = [p.untyped_storage().data_ptr() for p in params]
        call(answer, params, masters, host_grads, optimizer)
        seen.append({"weights": [p.detach().clone() for p in params],
                     "masters": [m.detach().clone() for m in masters],
                     "grads_on_host": all(m.grad is None or m.grad.data_ptr() == g.data_ptr()
                                          for m, g in zip(masters, host_grads)),
                     "stepped": all(len(optimizer.state[m]) > 0 for m in masters),
                     "host_grads": [g.clone() for g in host_grads],
                     "freed": all(p.grad is None for p in params),
                     "in_place": storages == [p.untyped_storage().data_ptr() for p in params]})
    return seen


def _plain_steps(seed: int) -> list[dict]:
    model, batches = _mlp_case(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, fused=True)
    out = [{"weights": [p.detach().clone() for p in model.parameters()]}]
    for x, y in batches:
        model.loss(x, y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        out.append({"weights": [p.detach().clone() for p in model.parameters()], "grads": grads})
    return out


@exercise(points=2, timeout=20.0, reference="companion.offload.CPUOffloadOptimizer")
def check_offloaded_step(answer) -> str:
    """answer(params, masters, host_grads, optimizer): after backward, copy each p.grad into its
    host buffer and free it, step `optimizer` (over the host masters) with those gradients, and
    copy the masters back into the parameters in place."""
    for seed in fresh_seeds(2):
        seen, plain = _observe_step(answer, seed), _plain_steps(seed)
        for step, (got, before, want) in enumerate(zip(seen, plain, plain[1:]), 1):
            require(got["freed"], f"after step {step} a parameter still has .grad on the device",
                    hint="set p.grad = None once it is copied down: the device keeps the weights "
                         "only.")
            require(got["in_place"], f"after step {step} a parameter has new storage",
                    hint="copy the masters into the parameters in place (p.copy_(m) under "
                         "torch.no_grad()), so the weights stay on the device; do not rebind "
                         "p.data to the host master.")
            compare(got["host_grads"], want["grads"], name=f"host gradients after step {step}",
                    **_EXACT, hint="copy each p.grad into its host buffer: host_grads[i].copy_("
                                   "p.grad), then give it to the master: masters[i].grad = ...")
            require(got["grads_on_host"], f"after step {step} a master's .grad is not its host "
                    "buffer", hint="give each master its host buffer, masters[i].grad = "
                    "host_grads[i], not the device gradient: the optimizer runs on the host and "
                    "the device gradient is freed.")
            require(got["stepped"], f"after step {step} the optimizer holds no state for the "
                    "masters", hint="step the optimizer you are given (it updates the host "
                    "masters), not one of your own over the device parameters.")
            compare(got["weights"], want["weights"], name=f"weights after step {step}", **_EXACT,
                    known_wrong={
                        "the device weights did not change: after optimizer.step(), copy the "
                        "updated masters back up (p.copy_(m)).": plain[0]["weights"],
                        "copy up after optimizer.step(), not before: the weights lag one step.":
                            before["weights"]})
            compare(got["masters"], want["weights"], name=f"host masters after step {step}",
                    **_EXACT, hint="optimizer.step() updates the masters; do not overwrite them "
                                   "(copy masters -> parameters, not the other way).")
    return ("the same weights as AdamW on the device (bit for bit on the CPU), with only the "
            "weights there")


# ---------------------------------------------------------------- exercise 2: placement arithmetic

def _wrong_placements(P, setting, gpus, L) -> dict:
    kw = dict(setting, gpus_per_node=gpus, largest_layer_params=L)
    right = estimate.offload_placement(P, **kw)
    unbuffered = estimate.offload_placement(P, **kw, buffer_factor=1.0)
    wrong = {"DeepSpeed multiplies every host figure by additional_buffer_factor = 1.5.":
             (right.device, unbuffered.host)}
    if setting["zero_stage"] == 3:
        wrong["at ZeRO-3 the GPU also gathers the largest layer: add 4 x largest_layer_params."] = (
            right.device - 4 * L, right.host)
    if setting["zero_stage"] == 2 and setting["offload_optimizer"] == "cpu":
        wrong["the host holds P x max(4 x gpus, 16) x 1.5: each GPU's process first loads the fp32 "
              "model (4 bytes) on the host."] = (right.device, int(16 * P * 1.5))
    wrong["host bytes are per node, not per GPU: do not divide them by the number of GPUs."] = (
        right.device, right.host // gpus)
    wrong["return (device_bytes, host_bytes) in that order: the device column first."] = (
        right.host, right.device)
    return wrong


@exercise(points=1, reference=("companion.estimate.offload_placement",
                               "companion.estimate_offload.offload_placement"))
def check_placement_arithmetic(answer) -> str:
    """answer(n_params, *, zero_stage, offload_optimizer, offload_params, gpus, largest_layer_params)
    -> (device_bytes, host_bytes) per DeepSpeed's estimators, one node, zero_init, buffer 1.5."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = 0
    for setting in estimate.OFFLOAD_LADDER:
        for gpus in (1, 3, rng.choice([5, 7, 8])):   # 6: 16 x 1.5 == 24 x 1, ambiguous
            P, L = rng.randrange(10**6, 10**10), rng.randrange(10**4, 10**8)
            got = call(answer, P, gpus=gpus, largest_layer_params=L, **setting)
            want = estimate.offload_placement(P, **setting, gpus_per_node=gpus,
                                              largest_layer_params=L)
            compare(got, (want.device, want.host), name=f"(device, host) for {setting}, "
                    f"{P} parameters, {gpus} GPU(s), largest layer {L}", **_EXACT,
                    hint="follow the table above: the device column, then the host column, "
                         "each division truncated to whole bytes with int(...) as DeepSpeed does "
                         "(not round or ceil).",
                    known_wrong=_wrong_placements(P, setting, gpus, L))
            require(all(isinstance(v, int) and not isinstance(v, bool) for v in got),
                    f"got {tuple(type(v).__name__ for v in got)}; bytes are whole numbers",
                    hint="return Python ints: DeepSpeed truncates with int(...).")
            cases += 1
    return f"matches DeepSpeed's estimators on {cases} settings"


# ---------------------------------------------------------------- exercise 3: what to offload

def _budget_cases(seed: int) -> list[tuple]:
    """Budgets a byte above each rung's needs first, then exactly each rung's needs (where only
    <= against < tells answers apart), then a device budget below every rung."""
    rng, roomy, exact = random.Random(seed), [], []
    for _ in range(6):
        P, gpus, L = rng.randrange(10**8, 10**11), rng.choice([1, 2, 8, 16]), rng.randrange(10**7)
        placed = [estimate.offload_placement(P, **s, gpus_per_node=gpus, largest_layer_params=L)
                  for s in estimate.OFFLOAD_LADDER]
        for p in placed:                                   # each rung's own needs as the budget
            roomy += [(P, p.device + 1, p.host + 1, gpus, L), (P, p.device + 1, 10**15, gpus, L)]
            exact += [(P, p.device, p.host, gpus, L), (P, p.device, 10**15, gpus, L)]
        roomy.append((P, min(p.device for p in placed) - 1, 10**15, gpus, L))
    return roomy + exact


def _first_fit(P, device, host, gpus, L, *, strict=(), host_too=True):
    """The reference's loop, or a known mistake: `strict` ("device", "host") compares with <."""
    fits = {side: (lambda need, budget: need < budget) if side in strict else
            (lambda need, budget: need <= budget) for side in ("device", "host")}
    for setting in estimate.OFFLOAD_LADDER:
        p = estimate.offload_placement(P, **setting, gpus_per_node=gpus, largest_layer_params=L)
        if fits["device"](p.device, device) and (not host_too or fits["host"](p.host, host)):
            return setting
    return None


def _most_offloaded(P, device, host, gpus, L):
    fits = [s for s in estimate.OFFLOAD_LADDER
            if (p := estimate.offload_placement(P, **s, gpus_per_node=gpus,
                                                largest_layer_params=L)).device <= device
            and p.host <= host]
    return fits[-1] if fits else None


def _wrong_choices(P, device, host, gpus, L, want) -> dict:
    wrong = {}
    if want is None:
        wrong["nothing fits here, so the answer is None: return None when no setting fits (not "
              "the last rung), and pass largest_layer_params (even the last rung gathers the "
              "largest layer on each GPU)."] = estimate.OFFLOAD_LADDER[-1]
    else:
        wrong["return the setting (the dict) itself, not its position in the ladder."] = (
            estimate.OFFLOAD_LADDER.index(want))
    wrong.update({
        "a setting that needs exactly the budget fits: compare with <=, not <.":
            _first_fit(P, device, host, gpus, L, strict=("device", "host")),
        "a setting that needs exactly the device budget fits: compare with <=, not <.":
            _first_fit(P, device, host, gpus, L, strict=("device",)),
        "a setting that needs exactly the host budget fits: compare with <=, not <.":
            _first_fit(P, device, host, gpus, L, strict=("host",)),
        "pass gpus_per_node=gpus to offload_placement: the GPUs share the model states.":
            _first_fit(P, device, host, 1, L),
        "pass largest_layer_params too: at ZeRO-3 each GPU gathers the largest layer.":
            _first_fit(P, device, host, gpus, 0),
        "the host must fit too: offloaded states need host RAM (check host_budget).":
            _first_fit(P, device, host, gpus, L, host_too=False),
    })
    wrong["the ladder is fastest first: return the first setting that fits, not the one that "
          "offloads the most."] = _most_offloaded(P, device, host, gpus, L)
    return wrong


@exercise(points=1, reference=("companion.estimate.choose_offload",
                               "companion.estimate_offload.choose_offload",
                               "companion.checks.ch08._first_fit"))
def check_choose_offload(answer) -> str:
    """answer(n_params, *, device_budget, host_budget, gpus, largest_layer_params) -> the first
    setting of OFFLOAD_LADDER whose placement fits both budgets, or None."""
    cases = _budget_cases(fresh_seeds(1)[0])
    for P, device, host, gpus, L in cases:
        got = call(answer, P, device_budget=device, host_budget=host, gpus=gpus,
                   largest_layer_params=L)
        want = estimate.choose_offload(P, device_budget=device, host_budget=host,
                                       gpus_per_node=gpus, largest_layer_params=L)
        compare(got, want, name=f"setting for {P} parameters, {gpus} GPU(s), device budget "
                f"{format_bytes(device)}, host budget {format_bytes(host)}",
                hint="walk OFFLOAD_LADDER in order and return the first setting (the dict "
                     "itself) whose device and host bytes both fit; None if none does.",
                known_wrong=_wrong_choices(P, device, host, gpus, L, want))
    return f"picks the fastest setting that fits in {len(cases)} cases"


# ---------------------------------------------------------------- exercise 4: pack and unpack

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
    a leaf that does not require grad."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(min_bytes // 24 + 1, 13, generator=g, requires_grad=True) * 2   # not a leaf
    return [base[:, 1::2], base.to(torch.bfloat16), base.detach().exp().T.contiguous()]


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
                      "nbytes": t.numel() * t.element_size()})
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
    return grads, moved.bytes_to_host, tr.peak, offloaded.peak, wrong


def _check_trip(trip: dict, expected: torch.Tensor, index: int) -> None:
    compare(trip["back"], expected, name=f"unpack(pack(t)) for test tensor {index}", **_EXACT,
            hint="unpack must give back exactly the tensor pack received: same values, dtype "
                 "and shape.")
    require(trip["host"] == trip["nbytes"],
            f"pack put {trip['host']} bytes on the host for a {trip['nbytes']}-byte tensor",
            hint="pack must copy a large tensor to the host with offload.to_host(t) (t.clone() "
                 "stays on the device; returning t moves nothing).")
    require(trip["device"] == trip["nbytes"],
            f"unpack allocated {trip['device']} device bytes; it should bring back "
            f"{trip['nbytes']}",
            hint="unpack must copy the tensor back to its device: offload.to_device(host, "
                 "device) (the host copy is not on the device).")


@exercise(points=2, timeout=20.0, reference="companion.offload.OffloadActivations")
def check_offload_hooks(answer) -> str:
    """answer(min_bytes) -> (pack, unpack): saved-tensor hooks that move every saved tensor of at
    least min_bytes that is not a parameter to the host, and bring it back to its device."""
    for seed in fresh_seeds(2):
        seen = _observe_hooks(answer, seed)
        expected = _trip_tensors(seed, seen["min_bytes"])
        for i, (trip, want) in enumerate(zip(seen["trips"], expected)):
            _check_trip(trip, want.detach(), i)
        grads, moved, plain_peak, reference_peak, wrong = _plain_and_reference(seed)
        compare(seen["grads"], grads, name="gradients with your hooks", **_EXACT,
                hint="every unpacked tensor must equal the one packed, so gradients do not change.")
        compare(seen["host_peak"], moved, name="bytes your hooks kept on the host",
                hint="move each saved tensor that holds at least min_bytes and is not a "
                     "parameter: nothing more, nothing less.", known_wrong=wrong)
        require(seen["peak"] <= reference_peak + reference_peak // 50 + 1024,
                f"the device peak with your hooks is {format_bytes(seen['peak'])}; moving the "
                f"same tensors should bring it to {format_bytes(reference_peak)} (without hooks: "
                f"{format_bytes(plain_peak)})",
                hint="don't keep a reference to t in what pack returns (or anywhere else): the "
                     "device copy must be free to go once its host copy is made.")
    return (f"gradients unchanged; {format_bytes(moved)} of saved tensors wait on the host; "
            f"device peak {format_bytes(plain_peak)} -> {format_bytes(seen['peak'])}")
