"""`python -m companion plan --model llama-3-70b --gpus 64 --gpus-per-node 8`: the parallel
layouts (`companion.plan.parallel`) that fit, fastest first, as text or JSON.

Example:
    >>> report = plan_parallel("llama-3-70b", gpus=64, gpus_per_node=8, seq_len=8192,
    ...                        batch="4M-tokens")
    >>> print(format_parallel(report))
"""
from __future__ import annotations

import dataclasses

from companion.memory import format_bytes

__all__ = ["ParallelPlan", "plan_parallel", "parallel_dict", "format_parallel", "FORMULA_ONLY"]

FORMULA_ONLY = ("Memory here is the tensors by formula (companion.plan.parallel) and the lines beyond "
                "them the single-axis planner counts (context, cuBLAS, FlashAttention scratch, "
                "NCCL, one segment of headroom), not a simulated step replayed through the "
                "allocator: fragmentation beyond that segment is not counted; keep a margin. "
                "Tensor parallelism is charged its communication only, its smaller per-rank "
                "matmuls at full efficiency.")


@dataclasses.dataclass
class ParallelPlan:
    """The layouts that fit, fastest first, and what they were planned for."""

    name: str
    n_params: int
    gpu: object
    gpus: int
    gpus_per_node: int
    seq_len: int
    batch: int                     # sequences a step
    budget: int
    plans: list                    # of parallel.Estimate
    searched: int                  # valid layouts priced


def plan_parallel(model: str, *, gpu: str = "H100 SXM", gpus: int = 8, gpus_per_node: int = 8,
                  seq_len: int | None = None, batch="4M-tokens",
                  budget: int | None = None) -> ParallelPlan:
    """The parallel layouts of a shipped Llama (or a config.json) on `gpus` GPUs, `gpus_per_node`
    to a node, within `budget` bytes a GPU (default the card's usable bytes)."""
    from companion.cost import gpus as table
    from companion.plan import parallel
    from companion.plan.configs import load_config
    from companion.plan.named import _whole, parse_batch

    _whole("gpus", gpus)
    _whole("gpus_per_node", gpus_per_node)
    if gpus % gpus_per_node and gpus > gpus_per_node:
        raise ValueError(f"{gpus} GPUs are not whole nodes of {gpus_per_node}")
    config = load_config(model)
    shape = parallel.Shape.from_config(config)
    seq_len = config.max_seq_len if seq_len is None else _whole("seq_len", seq_len)
    if seq_len > config.max_seq_len:
        raise ValueError(f"{config.name} takes at most {config.max_seq_len} tokens, got "
                         f"seq_len={seq_len}")
    card = table.gpu(gpu)
    budget = card.usable_bytes if budget is None else _whole("budget (bytes)", budget)
    sequences = parse_batch(batch, seq_len)
    found = list(parallel.layouts(shape, gpus=gpus, gpus_per_node=min(gpus_per_node, gpus),
                                  seq_len=seq_len, batch=sequences))
    plans = [parallel.estimate(shape, layout, seq_len, gpu=card,
                               gpus_per_node=min(gpus_per_node, gpus)) for layout in found]
    plans = sorted((e for e in plans if e.fit(budget).fits),
                   key=lambda e: (e.seconds, e.total_bytes))
    return ParallelPlan(config.name, shape.n_params, card, gpus, gpus_per_node, seq_len,
                        sequences, budget, plans, len(found))


def _row(e, budget: int) -> dict:
    fit = e.fit(budget)
    return {"plan": ", ".join(e.layout.levers()), "levers": e.layout.levers(),
            "layout": dataclasses.asdict(e.layout), "gpu_bytes": fit.total,
            "tensor_bytes": e.total_bytes, "checked": "formula", "stage": e.stage,
            "memory_lines": [{"name": x.name, "bytes": int(x.value), "source": x.formula}
                             for x in e.memory]
            + [{"name": o.name, "bytes": o.bytes, "source": o.source} for o in fit.lines],
            "seconds": {**{x.name: x.value for x in e.time}, "total": e.seconds}}


def parallel_dict(report: ParallelPlan, *, top: int = 10) -> dict:
    """The plans that fit, fastest first, as JSON-ready data."""
    return {"model": report.name, "n_params": report.n_params, "gpu": report.gpu.name,
            "gpus": report.gpus, "gpus_per_node": report.gpus_per_node,
            "batch_sequences": report.batch, "seq_len": report.seq_len,
            "budget": report.budget, "layouts_priced": report.searched,
            "chosen": _row(report.plans[0], report.budget) if report.plans else None,
            "plans": [_row(e, report.budget) for e in report.plans[:top]],
            "not_known": [FORMULA_ONLY]}


def format_parallel(report: ParallelPlan, *, top: int = 5) -> str:
    """The `top` fastest layouts with their memory per GPU and step time by part."""
    out = [f"{report.name}: {report.n_params:,} parameters; {report.batch} sequences of "
           f"{report.seq_len} tokens a step on {report.gpus} x {report.gpu.name}, "
           f"{report.gpus_per_node} to a node ({format_bytes(report.budget)} each); "
           f"{report.searched} layouts priced, {len(report.plans)} fit"]
    if not report.plans:
        out.append("No layout fits: more GPUs, a shorter sequence or a smaller batch.")
    for i, e in enumerate(report.plans[:top], 1):
        parts = ", ".join(f"{x.name} {x.value:.2f}s" for x in e.time if x.value)
        out.append(f"{i}. {', '.join(e.layout.levers())}: step {e.seconds:.2f} s ({parts})")
        fit = e.fit(report.budget)
        out.append(f"   GPU memory {format_bytes(fit.total)} of "
                   f"{format_bytes(report.budget)} (formula, "
                   + ("one stage" if e.stage == "only" else f"the {e.stage} pipeline stage")
                   + f"; tensors {format_bytes(e.total_bytes)}):")
        out += [f"     {x.name}: {format_bytes(int(x.value))}  [{x.formula}]" for x in e.memory]
        out += [f"     {o}" for o in fit.lines]
    out.append(FORMULA_ONLY)
    out.append("Not searched: expert parallelism, ZeRO-2, ZeRO-3 beside pipelining (priced 30-37% "
               "under torchtitan's measured 405B runs), uneven pipeline "
               "stages, offload and 8-bit states with t, p or c.")
    return "\n".join(out)
