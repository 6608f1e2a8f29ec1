"""Plan a published model on a GPU: `python -m companion plan --model gpt2-xl | llama-3-8b |
PATH/config.json --gpu "H100 SXM" --gpus 8 --seq-len 4096 --batch 1M-tokens`.

The model comes from a Hugging Face `config.json` (`companion.plan.configs`: GPT-2 and Llama,
Mistral, Qwen2 shapes; a few ship with the package) built as the course's `GPT` or `Llama` on
fake tensors, so the planner predicts it with its formulas and simulates the chosen step as it
does the course GPT's. Each plan that fits is printed with its GPU memory by line (the step's
tensors, the context, workspaces, NCCL, rounding and fragmentation: `plan.budget`) and its step
time by part (`predict_seconds`, at the named GPU's speeds). A Llama shape is predicted as the
course's GPT is (`companion.plan.predict`: its own activations, GQA, SwiGLU, tied embeddings,
q/k/v biases) with every lever but autocast outside ZeRO-3 (LoRA on its seven Linears); its
simulated step runs RMSNorm as CUDA's fused kernel saves. Llama 3 8B on 8 H100s: by formula in
~5 s on this course's CPU; the chosen plan's ZeRO-3 step simulated on fake tensors ~40 s more.

Not levers yet: tensor and pipeline parallelism, sequence parallelism and context parallelism
(a model whose layer does not fit one GPU is out of reach here), expert parallelism.
"""
from __future__ import annotations

import re

from companion.memory import format_bytes
from companion.plan.space import EXACT, LLAMA_NOT_SEARCHED, LOW_PRECISION

__all__ = ["parse_batch", "plan_named", "plan_dict", "format_plans", "DEFAULT_ALLOW"]

DEFAULT_ALLOW = EXACT + LOW_PRECISION
_TOKENS = re.compile(r"^\s*([0-9.]+)\s*([kKmMgG]?)\s*-?\s*tokens?\s*$")


def parse_batch(text: str | int, seq_len: int, gpus: int = 1) -> int:
    """Sequences per optimizer step from "256" (sequences) or "1M-tokens" (2^20 tokens: K, M and
    G are powers of 1024, as the Llama and GPT-3 papers count batch tokens), rounded down to a
    multiple of `gpus` sequences (at least `gpus`)."""
    if isinstance(text, int) or str(text).strip().isdigit():
        sequences = int(text)
    else:
        found = _TOKENS.match(str(text))
        if not found:
            raise ValueError(f"--batch is a number of sequences (256) or of tokens (1M-tokens, "
                             f"512K-tokens), got {text!r}")
        tokens = float(found[1]) * 1024 ** " kmg".index(found[2].lower() or " ")
        sequences = int(tokens // seq_len)
    sequences -= sequences % gpus
    if sequences < gpus:
        raise ValueError(f"the batch is fewer sequences of {seq_len} tokens than the {gpus} "
                         "GPUs: give a larger batch")
    return sequences


def plan_named(model: str, *, gpu: str = "H100 SXM", gpus: int = 1, seq_len: int | None = None,
               batch: str | int = "1M-tokens", budget: int | None = None,
               host_budget: int | None = None, allow=DEFAULT_ALLOW, verify: int = 1,
               cost=None):
    """The planner's answer for a shipped model name or a config.json path on `gpus` GPUs;
    `cost`: a `CostModel` for the time (default `CostModel.for_gpu(gpu)`)."""
    from companion.cost import gpus as table
    from companion.plan.configs import load_config
    from companion.plan.planner import plan

    config = load_config(model)
    seq_len = seq_len or config.max_seq_len
    card = table.gpu(gpu)
    sequences = parse_batch(batch, seq_len, gpus)
    result = plan(config.model_fn(seq_len), sequences, budget=budget or card.memory_bytes,
                  device="cuda", gpu=card.name, world_size=gpus, allow=allow,
                  host_budget=host_budget, verify=verify, simulate_plain=False, cost=cost)
    result.config = config
    return result


def _row(r) -> dict:
    return {"plan": r.candidate.describe(), "levers": r.candidate.techniques(),
            "gpu_bytes": r.fit.total, "checked": r.fit.how,
            "memory_lines": [{"name": "tensors at the peak", "bytes": r.predicted.peak,
                              "source": "predict_memory (" + r.predicted.phase + ")"}]
            + [{"name": o.name, "bytes": o.bytes, "source": o.source} for o in r.fit.lines],
            "host_bytes": r.predicted.host, "disk_bytes": r.predicted.disk,
            "seconds": r.seconds}


def plan_dict(result, *, top: int = 10) -> dict:
    """The plans that fit, fastest first, as JSON-ready data."""
    config = getattr(result, "config", None)
    return {"model": config.name if config else None, "n_params": result.shape.n_params,
            "gpu": result.gpu.name if result.gpu else None, "gpus": result.world_size,
            "batch_sequences": result.batch, "seq_len": result.shape.seq_len,
            "budget": result.budget, "chosen": _row(result.chosen_row),
            "plans": [_row(r) for r in _fitting(result)[:top]],
            "failed_when_simulated": [r.candidate.describe() for r in _failed(result)]}


def _failed(result) -> list:
    return [r for r in result.rows if r.fit.how == "replayed" and not r.fit.fits]


def _fitting(result) -> list:
    """Plans predicted to fit, fastest first, less those whose simulated step did not."""
    return [r for r in result.rows if r.fit.fits]


def format_plans(result, *, top: int = 5) -> str:
    """The table, then the `top` fastest plans with their memory lines and time parts."""
    out, sources = [result.table(limit=top), ""], {}
    for r in _failed(result):
        out.append(f"Predicted to fit, but its simulated step does not when replayed through "
                   f"the allocator: {r.candidate.describe()} ({r.fit.lines[-1].source}).")
    for i, r in enumerate(_fitting(result)[:top], 1):
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in r.seconds.items() if k != "total" and v)
        out.append(f"{i}. {r.candidate.describe()}: step {r.seconds['total']:.2f} s ({parts})")
        if r.fit is not None:
            out.append(f"   GPU memory {format_bytes(r.fit.total)} of "
                       f"{format_bytes(result.budget)} ({r.fit.how}): tensors "
                       f"{format_bytes(r.predicted.peak)} at the {r.predicted.phase} phase")
            out += [f"     {o.name}: {format_bytes(o.bytes)}" for o in r.fit.lines]
            sources.update({o.name: o.source for o in r.fit.lines})
        if r.predicted.host:
            out.append(f"   host {format_bytes(r.predicted.host)}"
                       + (f", disk {format_bytes(r.predicted.disk)}" if r.predicted.disk else ""))
    out.append("Where the lines come from:")
    out += [f"  {name}: {source}" for name, source in sources.items()]
    out.append("Not searched: tensor and pipeline parallelism (one layer must fit one GPU).")
    if result.shape.llama:
        out += ["Not searched for a Llama:"] + [f"  {why}" for why in LLAMA_NOT_SEARCHED]
    return "\n".join(out)
