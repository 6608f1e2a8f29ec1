"""What the planner knows of a model: formulas for the course's families, a traced step for any other.

`plan` takes one path whatever the model is (`planner`): it lists the candidates, predicts each
one's peak and step time, adds the lines a GPU holds beyond the tensors (`budget`), keeps those
that fit, simulates the fastest on fake tensors until one's simulated step fits too, and prints
one report. Only the first steps differ by what is known of the model, and this module holds
them, behind the same four methods (`candidates`, `predict`, `lines`, `simulate`):

- `Formulas`: a `companion.models.GPT` or `Llama`, which a published config.json builds
  (`configs`). Peaks come from `predict`'s formulas, phase by phase, for every lever of
  `space.TECHNIQUES`, and the chosen plan is checked by `simulation.simulate`.
- `Traced`: any `nn.Module` with a step function. Its peaks come from its own step, traced on
  fake tensors (`anysim.simulate_model`): each combination of levers at its smallest and largest
  micro-batch, the sizes in between interpolated (memory and FLOPs grow linearly with the
  micro-batch), the levers `GENERIC` names.

`describe(model_fn, step=...)` picks: the formulas when the model is one of theirs and no step
is given, the trace otherwise.

Simplified: the trace knows no ZeRO, offload or QLoRA (the course's own training loop runs
those, `training`), plans one device, and prices time from counted FLOPs at the cost model's rate
plus a fixed cost per block and micro-batch.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from typing import Callable, Iterable

import torch
from torch import nn
from torch._subclasses import FakeTensorMode

from companion import allocator, lora
from companion.memory import MemoryTracker
from companion.plan import budget as budgets
from companion.plan import fallback as fallbacks
from companion.plan.anysim import (_checkpoint, _runs_checkpoint, blocks_of, build_model,
                                   checkpointed_already, count_flops, hf_layers, hf_switch,
                                   measure_step, next_token_step, simulate_memory)
from companion.plan.costmodel import CostModel
from companion.plan.predict import (ADAM8BIT_BYTES, Prediction, predict_memory,
                                    predict_seconds)
from companion.plan.simulation import simulate
from companion.plan.space import Candidate, GPTShape, candidates, lora_target_names

__all__ = ["GENERIC", "Formulas", "Traced", "describe"]

GENERIC = ("accumulation", "checkpointing", "autocast", "lora", "adam8bit")


def describe(model_fn: Callable[..., nn.Module], *, step: Callable | None = None,
             seq_len: int | None = None, vocab: int | None = None,
             optimizer: Callable = torch.optim.AdamW) -> "Formulas | Traced":
    """The formulas for a course GPT or Llama built by `model_fn(dtype=, device=)` when no `step`
    is given; else (or for any other model) the model's own step, traced."""
    if isinstance(model_fn, nn.Module) or not callable(model_fn):
        GPTShape.of(model_fn)                          # raises, saying what to pass
    if step is None:
        try:
            return Formulas(model_fn, GPTShape.of(model_fn))
        except TypeError:
            pass
    return Traced(model_fn, step=step, seq_len=seq_len, vocab=vocab, optimizer=optimizer)


class Formulas:
    """A course GPT or Llama: every lever, peaks and times from `predict`'s formulas."""

    how = "formulas"
    notes: tuple[str, ...] = ()
    note = None                                        # nothing to say beside the table

    def __init__(self, model_fn: Callable[..., nn.Module], shape: GPTShape):
        self.model_fn, self.shape = model_fn, shape
        self.n_params = shape.n_params
        self.step = None

    def allowed(self, allow: tuple[str, ...]) -> tuple[str, ...]:
        return allow                                   # `candidates` checks the names

    def candidates(self, batch: int, *, world_size: int, allow: Iterable[str],
                   lora_rank: int, lora_targets: tuple[str, ...] = ()) -> list[Candidate]:
        return candidates(self.shape, batch, world_size=world_size, allow=allow,
                          lora_rank=lora_rank, lora_targets=lora_targets)

    def predict(self, cand: Candidate, *, world_size: int, device_type: str, cost: CostModel
                ) -> tuple[Prediction, dict[str, float]]:
        return (predict_memory(self.shape, cand, world_size=world_size, device_type=device_type),
                predict_seconds(self.shape, cand, cost, world_size=world_size))

    def lines(self, cand: Candidate, *, device_type: str, gpu, world_size: int,
              context_bytes: int | None) -> list[allocator.Overhead]:
        return budgets.lines(self.shape, cand, device_type=device_type, gpu=gpu,
                             world_size=world_size, context_bytes=context_bytes)

    def largest_request(self, cand: Candidate) -> int:
        """The largest single allocation: an fp32 copy of the largest weight, or the logits of
        one micro-batch (of one slice with the chunked or the fused loss)."""
        tokens = cand.micro_batch * self.shape.seq_len
        return 4 * max(self.shape.largest, tokens * self.shape.vocab
                       // max(cand.chunked_loss, cand.fused_loss, 1))

    def traced(self, cand: Candidate) -> MemoryTracker | None:
        return None                                    # nothing simulated while predicting

    def simulate(self, cand: Candidate, *, world_size: int, device_type: str) -> MemoryTracker:
        return simulate(self.model_fn, cand, world_size=world_size, device_type=device_type,
                        shape=self.shape)


class Traced:
    """Any model with a step: each combination of `GENERIC` levers traced on fake tensors at its
    smallest and largest micro-batch, the sizes in between interpolated.

    When an op of the step cannot run on fake tensors (`fallback.diagnose`), `fallback=True`
    measures every row's real step on this CPU at small micro-batches and scales it
    (`fallback.scaled`; `how` becomes "measured and scaled", `notes` say so); `fallback=False`
    raises a RuntimeError that names the op, the module and why.

    The checkpointing lever on a Hugging Face model is its own switch, every layer recomputed
    (`anysim.hf_switch`; `note` says so beside the table); a model that recomputes its blocks
    already, in its factory or its own forward (`anysim.checkpointed_already`), is planned as it
    is, and `note` says that instead."""

    how = "traced"
    note: str | None = None          # what the model does itself that the plan must say

    def __init__(self, model_fn: Callable[[], nn.Module], *, step: Callable | None = None,
                 seq_len: int | None = None, vocab: int | None = None,
                 optimizer: Callable = torch.optim.AdamW, fallback: bool = True):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = build_model(model_fn)
        self.model_fn, self.optimizer, self.shape = model_fn, optimizer, None
        self.n_params = sum(p.numel() for p in model.parameters())
        if step is None:
            vocab = vocab or next((m.num_embeddings for m in model.modules()
                                   if isinstance(m, nn.Embedding)), None)
            seq_len = seq_len or getattr(model, "seq_len", None)
            if vocab is None or seq_len is None:
                raise ValueError("the default step feeds token ids to a language model: give "
                                 "seq_len (and vocab when the model has no nn.Embedding), or "
                                 "pass step(model, batch) -> loss")
            step = next_token_step(seq_len, vocab)
        self.step = step
        with mode, fallbacks.quiet():        # a step fake tensors cannot run: said later
            already = checkpointed_already(model, step)
        self._already = (None if already is None else
                         f"the model recomputes its blocks already ({already}): every row, the "
                         f"plain run's too, is checkpointed that way, and the checkpointing lever "
                         f"is not pulled again")
        self.note = self._already
        hf = hf_switch(model, blocks_of(model))
        if already:
            self.segments = 1
        elif hf is not None:                 # what its switch checkpoints: every layer
            self.segments = hf_layers(hf) or len(blocks_of(model))
        else:
            self.segments = _segments(model)
        self._inert = None
        if self.segments > 1 and hf is None and not already:
            container = blocks_of(model)
            _checkpoint(model, container)    # the lever on this probe's copy of the model
            with mode, fallbacks.quiet():
                if _runs_checkpoint(model, step) is False:
                    self.segments = 1
                    self._inert = (f"checkpointing is not offered: the lever wraps the forward "
                                   f"of each block of the model's largest block list "
                                   f"({type(container).__name__} of {len(container)} "
                                   f"{type(container[0]).__name__}), and the model never calls "
                                   f"them (it calls what they hold); checkpoint in your own "
                                   f"forward to plan with it")
        self._hf = (None if already or hf is None or self.segments < 2 else
                    f"checkpointing is Hugging Face's own switch, as its user turns it on: "
                    f"{type(hf).__name__}.gradient_checkpointing_enable() (newer transformers "
                    f"name it activation_checkpointing_enable()), each of its {self.segments} "
                    f"layers recomputed in backward, the last one too")
        self._traces: dict[Candidate, tuple[MemoryTracker, float, int]] = {}
        self._flops: dict[Candidate, int] = {}
        self._micro: list[int] = []
        self.fallback, self.unsimulable = fallback, None
        self._bases: set[str] = set()            # how the measured rows were scaled

    def allowed(self, allow: tuple[str, ...]) -> tuple[str, ...]:
        """The levers of `allow` a traced step can pull (`GENERIC`)."""
        return tuple(a for a in allow if a in GENERIC)

    def candidates(self, batch: int, *, world_size: int, allow: Iterable[str],
                   lora_rank: int, lora_targets: tuple[str, ...] = ()) -> list[Candidate]:
        if world_size != 1:
            raise ValueError("for a model other than the course GPT the planner plans one device "
                             "(world_size=1)")
        allow = frozenset(allow)
        if allow - set(GENERIC):
            raise ValueError(f"unknown lever(s) {sorted(allow - set(GENERIC))}: for any model "
                             f"choose from {', '.join(GENERIC)}")
        self.note = (self._hf if "checkpointing" in allow and self._hf else
                     self._inert if "checkpointing" in allow and self._inert else self._already)
        self._micro = ([m for m in range(1, batch + 1) if batch % m == 0]
                       if "accumulation" in allow else [batch])
        lora_targets = lora_target_names(lora_targets)
        if lora_targets and "lora" in allow:           # the names are the model's own
            _with_lora(self.model_fn, lora_rank, lora_targets)   # (raises, listing them)
        return [Candidate(m, batch // m, **combo,
                          lora_targets=tuple(lora_targets) if combo["lora_rank"] else ())
                for combo in _combos(allow, lora_rank, self.segments) for m in self._micro]

    def _trace(self, cand: Candidate) -> tuple[MemoryTracker, float, int]:
        """The candidate's simulated step (`anysim.simulate_memory`) and its FLOPs, counted in a
        run of their own (`anysim.count_flops`) once per micro-batch, checkpointing and LoRA
        rank (`_counted`)."""
        if cand not in self._traces:
            self._traces[cand] = self._simulated(cand)
        return self._traces[cand]

    def _counted(self, cand: Candidate) -> int:
        """The FLOPs of `cand`'s micro-batch, counted once for every accumulation, optimizer
        state and precision: autocast runs the same matmuls in another dtype (counted equal on
        transformers' Llama, T5, ViT and BERT), so a count made under either is the other's."""
        key = dataclasses.replace(cand, accumulation=1, state_bits=32)
        twin = dataclasses.replace(key, precision={"fp32": "autocast", "autocast": "fp32"}.get(
            key.precision, key.precision))
        if key not in self._flops and twin not in self._flops:
            self._flops[key] = count_flops(self.model_fn, key, self.step)
        return self._flops.get(key, self._flops.get(twin))

    def _simulated(self, cand: Candidate) -> tuple[MemoryTracker, float, int]:
        """The fake step; once an op of it could not run, the real one measured and scaled."""
        if self.unsimulable is None:
            try:
                with fallbacks.quiet():
                    tracker, blocks = simulate_memory(self.model_fn, cand, self.step,
                                                      optimizer=self.optimizer)
                    return tracker, self._counted(cand), blocks
            except Exception as e:
                found = fallbacks.diagnose(e)
                if found is None:
                    raise
                if not self.fallback:
                    raise RuntimeError(f"{found}. With fallback=True (the CLI without "
                                       f"--no-fallback) the planner measures the real step on "
                                       f"this CPU at small micro-batches and scales it; or "
                                       f"pass a step that avoids the op") from None
            self.unsimulable, self.how = found, "measured and scaled"
        def real(c: Candidate) -> tuple[MemoryTracker, int, int]:
            tracker, blocks = simulate_memory(self.model_fn, c, self.step,
                                              optimizer=self.optimizer, fake=False)
            return tracker, count_flops(self.model_fn, c, self.step, fake=False), blocks

        found = fallbacks.scaled(real, cand, self.n_params, self.unsimulable)
        self._bases.add(found[0].basis)
        return found

    @property
    def notes(self) -> list[str]:
        """What the plan prints of how its rows were found: nothing when all were simulated."""
        return fallbacks.note(self.unsimulable, self._bases) if self.unsimulable else []

    def predict(self, cand: Candidate, *, world_size: int, device_type: str, cost: CostModel
                ) -> tuple[Prediction, dict[str, float]]:
        """Bytes by kind and FLOPs interpolated between the combination's two traced ends."""
        ends = sorted({self._micro[0], self._micro[-1]}) if self._micro else [cand.micro_batch]
        if cand.micro_batch not in ends:
            ends = sorted({min(ends[0], cand.micro_batch), max(ends[-1], cand.micro_batch)})
        at = {m: self._trace(dataclasses.replace(cand, micro_batch=m,
                                                 accumulation=cand.micro_batch
                                                 * cand.accumulation // m)) for m in ends}
        lo, hi = at[ends[0]], at[ends[-1]]
        w = 0.0 if len(ends) == 1 else (cand.micro_batch - ends[0]) / (ends[-1] - ends[0])
        kinds = {k: round(lo[0].breakdown().get(k, 0) * (1 - w) + hi[0].breakdown().get(k, 0) * w)
                 for k in lo[0].breakdown()}
        near = at[min(ends, key=lambda e: abs(e - cand.micro_batch))][0]
        predicted = Prediction(parameters=kinds.get("parameters", 0) + kinds.get("buffers", 0),
                               gradients=kinds.get("gradients", 0),
                               optimizer_state=kinds.get("optimizer_state", 0),
                               activations=kinds.get("activations", 0),
                               temporaries=kinds.get("temporaries", 0),
                               phase=near.peak_phase or "step")
        flops = lo[1] * (1 - w) + hi[1] * w
        trainable = (self.n_params if not cand.lora_rank else
                     lora.trainable_params(_with_lora(self.model_fn, cand.lora_rank,
                                                     cand.lora_targets)))
        return predicted, _seconds(cand, flops, lo[2], trainable, cost)

    def lines(self, cand: Candidate, *, device_type: str, gpu, world_size: int,
              context_bytes: int | None) -> list[allocator.Overhead]:
        """On CUDA the context and cuBLAS's workspace (no attention kernel is known here)."""
        if device_type != "cuda":
            return []
        return allocator.step_overheads(gpu, context_bytes=context_bytes)

    def largest_request(self, cand: Candidate) -> int:
        return allocator.LARGE_REQUEST

    def traced(self, cand: Candidate) -> MemoryTracker | None:
        """The candidate's own trace, when predicting it traced it (its ends)."""
        found = self._traces.get(cand)
        return found[0] if found else None

    def simulate(self, cand: Candidate, *, world_size: int, device_type: str) -> MemoryTracker:
        return self._trace(cand)[0]

    def check(self, cand: Candidate) -> MemoryTracker:
        """The step of `cand` as a training loop runs it, for real on this CPU: built, stepped
        once, the next step measured by `track` alone (`anysim.measure_step`), not the
        simulation run on real tensors."""
        return measure_step(self.model_fn, cand, self.step, optimizer=self.optimizer)


def _seconds(cand: Candidate, flops: float, blocks: int, trainable: int, cost: CostModel
             ) -> dict[str, float]:
    """Counted FLOPs at the cost model's rate (bf16's with autocast), a fixed cost per block and
    micro-batch, and the optimizer streaming 32 bytes per trainable parameter (fused AdamW's
    count; `predict.ADAM8BIT_BYTES` for 8-bit states)."""
    rate = cost.flops * (cost.half_speedup if cand.precision == "autocast" else 1.0)
    per_param = ADAM8BIT_BYTES if cand.state_bits == 8 else 32
    parts = {"compute": cand.accumulation * flops / rate,
             "overhead": cand.accumulation * blocks * cost.layer_seconds,
             "optimizer": per_param * trainable / cost.memory_bandwidth}
    return {**parts, "total": sum(parts.values())}


def _segments(model: nn.Module) -> int:
    """What checkpointing makes of the model's blocks: one segment per block of a ModuleList,
    round(√n) segments of a Sequential; 1 when there are no blocks to checkpoint."""
    container = blocks_of(model)
    if container is None:
        return 1
    return (max(2, round(math.sqrt(len(container)))) if isinstance(container, nn.Sequential)
            else len(container))


def _combos(allow: frozenset[str], lora_rank: int, segments: int) -> list[dict]:
    return [dict(segments=s, precision=p, lora_rank=r, state_bits=b)
            for s, p, r, b in itertools.product(
                [1, segments] if "checkpointing" in allow and segments > 1 else [1],
                ["fp32", "autocast"] if "autocast" in allow else ["fp32"],
                [0, lora_rank] if "lora" in allow else [0],
                [32, 8] if "adam8bit" in allow else [32])
            if not (r and b == 8)]


def _with_lora(model_fn, lora_rank: int, targets: tuple[str, ...] = ()) -> nn.Module:
    with FakeTensorMode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return lora.apply_lora(build_model(model_fn), lora_rank, targets or None)
