"""A plan explained: which lever buys how many bytes at what time cost (`waterfall`,
`plot_waterfall`), and why a setup runs out of memory (`why_oom`, `nothing_fits`).

The waterfall starts from the plain run (the whole batch at once, fp32, every parameter trained)
and adds the chosen plan's levers one at a time, each time the one that saves the most bytes
among those left, predicting peak and step time after each (`predict`): the bars fall from the
plain run's peak to the plan's, and the time rises by what each lever costs.

Example:
    >>> p = plan(model_fn, 16, budget="8 MiB")
    >>> for step in waterfall(p): print(step)
    >>> plot_waterfall(p)
"""
from __future__ import annotations

import dataclasses

from companion.memory import format_bytes
from companion.plan.predict import predict_memory, predict_seconds
from companion.plan.space import Candidate

__all__ = ["Step", "waterfall", "plot_waterfall", "why_oom", "nothing_fits", "NothingFits"]

# The fields each lever sets, moved together (NVMe is offload's tier, NF4 is LoRA's base).
_LEVERS = {"micro-batches": ("micro_batch", "accumulation"), "checkpointing": ("segments",),
           "precision": ("precision",), "ZeRO": ("zero_stage",), "offload": ("offload", "nvme"),
           "activation offload": ("activation_offload",), "chunked loss": ("chunked_loss",),
           "fused attention": ("fused_attention",), "LoRA": ("lora_rank", "nf4_base"),
           "8-bit states": ("state_bits",), "fused loss": ("fused_loss",),
           "checkpoint inputs on the host": ("offload_checkpoints",)}


class NothingFits(ValueError):
    """No plan fits the budget; the message says by how much the closest one misses."""


@dataclasses.dataclass(frozen=True)
class Step:
    """The plan after one more lever: its name, the predicted peak and step time."""

    lever: str
    candidate: Candidate
    peak: int
    seconds: float

    def __str__(self) -> str:
        return (f"{self.lever:<22}{format_bytes(self.peak):>12}{self.seconds * 1e3:>11.1f} ms  "
                f"{self.candidate.describe()}")


def waterfall(plan) -> list[Step]:
    """From the plain run to `plan.chosen`, one lever at a time, largest saving first."""
    shape, cost, world = plan.shape, plan.cost, plan.world_size
    device_type = plan.device.type
    target, current = plan.chosen, plan.plain.candidate

    def score(c: Candidate) -> tuple[int, float]:
        return (predict_memory(shape, c, world_size=world, device_type=device_type).peak,
                predict_seconds(shape, c, cost, world_size=world)["total"])

    steps = [Step("plain run", current, *score(current))]
    left = [name for name, fields in _LEVERS.items()
            if any(getattr(target, f) != getattr(current, f) for f in fields)]
    while left:
        options = []
        for name in left:
            try:
                c = dataclasses.replace(current, **{f: getattr(target, f) for f in _LEVERS[name]})
            except ValueError:                     # needs another lever first (8 bits, NF4)
                continue
            options.append((score(c), name, c))
        if not options:
            break
        (peak, seconds), name, current = min(options, key=lambda o: o[0][0])
        steps.append(Step("+ " + name, current, peak, seconds))
        left.remove(name)
    return steps


def plot_waterfall(plan, ax=None):
    """Bars of the predicted peak after each lever, the budget as a line, each bar labelled
    with the step time; returns the axes."""
    import matplotlib.pyplot as plt
    steps = waterfall(plan)
    ax = ax or plt.subplots(figsize=(8, 3.2))[1]
    unit, name = (2**30, "GiB") if steps[0].peak > 2**32 else (2**20, "MiB")
    ax.bar(range(len(steps)), [s.peak / unit for s in steps], color="C0")
    for i, s in enumerate(steps):
        ax.annotate(f"{s.seconds * 1e3:.0f} ms" if s.seconds < 10 else f"{s.seconds:.1f} s",
                    (i, s.peak / unit), ha="center", va="bottom", fontsize=8)
    ax.axhline(plan.budget / unit, color="k", ls="--", lw=1, label="budget")
    ax.set_ylim(0, 1.15 * max(max(s.peak for s in steps), plan.budget) / unit)   # room for labels
    ax.set_xticks(range(len(steps)), [s.lever for s in steps], rotation=20, ha="right")
    ax.set(ylabel=f"predicted peak ({name})",
           title="From the plain run to the plan: bytes each lever buys (label: step time)")
    ax.legend()
    return ax


def why_oom(plain, rows, budget: int, *, top: int = 3, shape=None, cost=None,
            world_size: int = 1, base_seconds: float | None = None) -> str:
    """Why the `plain` row's setup does not fit: its largest terms against the budget, then the
    `top` fastest of `rows` that fit, with what each costs in time: against the step a
    practitioner would run, the whole batch in bf16 (autocast; given `shape` and `cost`, or a
    traced model's `base_seconds`), not the plain fp32 row (fp32 on the CUDA cores: at the cited
    factors 1.6x a bf16 step on an RTX 4090, 8.3x on an H100 SXM)."""
    p, fit = plain.predicted, plain.fit
    over = fit.total - budget
    kinds = sorted(p.kinds().items(), key=lambda kv: -kv[1])
    text = [f"the plain step needs {format_bytes(fit.total)} of {format_bytes(budget)}"
            + (f": {format_bytes(over)} over, at the {p.phase} phase" if over > 0 else ": it fits"),
            "  by term: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}"
                                      for k, v in kinds if v)]
    text += [f"    {o}" for o in fit.lines]
    fitting = sorted((r for r in rows if r.fit.fits and r is not plain), key=lambda r: r.seconds["total"])
    base, against = plain.seconds["total"], "the plain fp32 run's"
    if shape is not None and cost is not None:
        bf16 = dataclasses.replace(plain.candidate, precision="autocast")
        base = predict_seconds(shape, bf16, cost, world_size=world_size)["total"]
        against = f"a bf16 step of the whole batch ({base:.2f} s, predicted: it does not fit)"
    elif base_seconds is not None:
        base = base_seconds
        against = f"a bf16 step of the whole batch ({base:.2f} s, predicted)"
    for r in fitting[:top]:
        text.append(f"  fix: {r.candidate.describe()}: {format_bytes(r.fit.total)}, step "
                    f"{r.seconds['total']:.2f} s, {r.seconds['total'] / base:.2f}x {against}")
    if not fitting:
        text.append("  no plan with the allowed levers fits: allow more, or add GPUs")
    return "\n".join(text)


def nothing_fits(rows, usable: int, budget: int, allow, world_size: int,
                 host_budget: int | None, levers: tuple[str, ...] | None = None) -> NothingFits:
    """The error when no candidate fits: the closest one and what to try (of `levers`, those a
    traced model can pull, when given)."""
    within = [r for r in rows if host_budget is None or r.predicted.host <= host_budget]
    best = min(within, key=lambda r: r.fit.total)      # plans without offload: always within
    over = best.fit.total - usable
    searched = ("accumulation", "checkpointing", "autocast") + (
        ("mixed", "offload", "adam8bit", "lora", "qlora") if world_size == 1 else ("zero",))
    if levers is not None:
        searched = levers
    hints = [f"allow {name}" for name in searched if name not in allow]
    if world_size == 1 and levers is None:
        hints.append("train on more devices (world_size > 1, ZeRO)")
    hints.append("shorten the sequences or shrink the model")
    on_host = [r.predicted.host for r in rows if r.fit.fits]
    if on_host:                                        # they fit the device, not the host
        hints.insert(0, f"give the host {format_bytes(min(on_host))} (host_budget)")
    host = (f" (host budget {format_bytes(host_budget)} rules out offload plans that need more)"
            if host_budget is not None else "")
    beyond = best.fit.total - best.predicted.peak                # the GPU's lines (CUDA)
    needs = (f"its predicted peak {format_bytes(best.predicted.peak)} and "
             f"{format_bytes(beyond)} of context, workspaces and headroom" if beyond > 0
             else "its predicted peak")
    return NothingFits(
        f"no plan fits {format_bytes(usable)}"
        + (f" (the budget {format_bytes(budget)} less the margin)" if usable < budget else "")
        + f"{host}: the closest needs {format_bytes(best.fit.total)}, {needs} "
        f"({best.candidate.describe()}), {format_bytes(over)} over, "
        f"{100 * over / max(usable, 1):.0f}% too much. To go further: " + "; ".join(hints) + ".")
