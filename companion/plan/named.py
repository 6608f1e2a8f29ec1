"""Plan a published model on a GPU: `python -m companion plan --model gpt2-xl | llama-3-8b |
PATH/config.json --gpu "H100 SXM" --gpus 8 --seq-len 4096 --batch 1M-tokens`.

The model comes from a Hugging Face `config.json` (`companion.plan.configs`: GPT-2 and Llama,
Mistral, Qwen2 shapes; a few ship with the package) built as the course's `GPT` or `Llama` on
fake tensors, so the planner predicts it with its formulas and simulates the chosen step as it
does the course GPT's. Each plan that fits is printed with its GPU memory by line (the step's
tensors, the context, workspaces, NCCL, rounding and fragmentation: `plan.budget`) and its step
time by part (`predict_seconds`, at the named GPU's speeds). The budget is the card's usable
bytes (`cost.gpus.GPU.usable_bytes`, what CUDA reports), and every plan printed as fitting had
its simulated step replayed through the allocator (`planner.plan`'s `show`). A Llama shape is predicted as the
course's GPT is (`companion.plan.predict`: its own activations, GQA, SwiGLU, tied embeddings,
q/k/v biases) with every lever but autocast outside ZeRO-3 (LoRA on its seven Linears); its
simulated step runs RMSNorm as CUDA's fused kernel saves. Llama 3 8B on 8 H100s: by formula in
~5 s on this course's CPU; the five plans listed, each a ZeRO-3 step simulated on fake tensors
and replayed, ~30 s more.

Tensor, sequence, pipeline and context parallelism are levers of another path: with
`--gpus-per-node` (or when no plan here fits), a Llama is planned over t·p·c·d GPUs by formula
(`companion.plan.parallel_report`, memory not replayed through the allocator). Not levers yet:
expert parallelism, and t, p or c beside this path's offload, LoRA and 8-bit states.
"""
from __future__ import annotations

import re

from companion.memory import format_bytes
from companion.plan.space import EXACT, LLAMA_NOT_SEARCHED, LOW_PRECISION

__all__ = ["parse_batch", "plan_named", "plan_dict", "format_plans", "DEFAULT_ALLOW", "NOT_KNOWN"]

DEFAULT_ALLOW = EXACT + LOW_PRECISION
_TOKENS = re.compile(r"^\s*([0-9.]+)\s*([kKmMgG]?)\s*-?\s*tokens?\s*$")


def _whole(name: str, value, low: int = 1) -> int:
    """`value` if it is a whole number of at least `low` (not a bool), else a ValueError that
    names it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be a whole number of at least {low}, got {value!r}")
    return value


def parse_batch(text: str | int, seq_len: int, gpus: int = 1) -> int:
    """Sequences per optimizer step from "256" (sequences) or "1M-tokens" (2^20 tokens: K, M and
    G are powers of 1024, as the Llama and GPT-3 papers count batch tokens), rounded down to a
    multiple of `gpus` sequences (at least `gpus`)."""
    seq_len, gpus = _whole("seq_len", seq_len), _whole("gpus", gpus)
    if isinstance(text, bool):
        raise ValueError(f"--batch is a number of sequences, got {text!r}")
    if isinstance(text, int) or str(text).strip().isdigit():
        sequences = int(text)
        if sequences < 1:
            raise ValueError(f"--batch must be at least 1 sequence, got {text!r}")
    else:
        found = _TOKENS.match(str(text))
        try:
            tokens = float(found[1]) * 1024 ** " kmg".index(found[2].lower() or " ")
        except (TypeError, ValueError):          # no match, or a number such as "1..2"
            raise ValueError(f"--batch is a number of sequences (256) or of tokens (1M-tokens, "
                             f"512K-tokens), got {text!r}") from None
        sequences = int(tokens // seq_len)
    sequences -= sequences % gpus
    if sequences < gpus:
        raise ValueError(f"the batch ({text}) is fewer sequences of {seq_len} tokens than the "
                         f"{gpus} GPU(s): give a larger batch")
    return sequences


def plan_named(model: str, *, gpu: str = "H100 SXM", gpus: int = 1, seq_len: int | None = None,
               batch: str | int = "1M-tokens", budget: int | None = None,
               host_budget: int | None = None, allow=DEFAULT_ALLOW, verify: int = 1,
               show: int = 5, cost=None, lora_rank: int = 8, lora_targets=()):
    """The planner's answer for a shipped model name or a config.json path on `gpus` GPUs,
    within `budget` bytes per GPU (default the card's usable bytes, `GPU.usable_bytes`: what
    CUDA reports, not the nominal size); the `show` fastest plans are each replayed. `cost`: a
    `CostModel` for the time (default `CostModel.for_gpu(gpu)`). Every number is checked first
    (a ValueError names it): `seq_len` None means the config's longest, never 0."""
    from companion.cost import gpus as table
    from companion.plan.configs import load_config
    from companion.plan.planner import plan

    _whole("gpus", gpus)
    _whole("verify", verify, 0)
    _whole("show", show, 0)
    _whole("lora_rank", lora_rank)
    if budget is not None:
        _whole("budget (bytes)", budget)
    if host_budget is not None and not isinstance(host_budget, str):   # "64GiB": the planner's
        _whole("host_budget (bytes)", host_budget, 0)
    if seq_len is not None:
        _whole("seq_len", seq_len)
    config = load_config(model)
    seq_len = config.max_seq_len if seq_len is None else seq_len
    card = table.gpu(gpu)
    sequences = parse_batch(batch, seq_len, gpus)
    result = plan(config.model_fn(seq_len), sequences, budget=card.usable_bytes if budget is None else budget,
                  device="cuda", gpu=card.name, world_size=gpus, allow=allow,
                  host_budget=host_budget, verify=verify, simulate_plain=False, show=show,
                  cost=cost, lora_rank=lora_rank, lora_targets=lora_targets)
    result.config = config
    return result


def _tensors(r) -> tuple[int, str]:
    """The step's tensors at the peak: simulated when the step was replayed (the lines beside
    them were measured against it), else predicted."""
    if r.fit.how in ("replayed", "simulated") and r.simulated is not None:
        return r.simulated, "the simulated step (FakeTensorMode)"
    return r.predicted.peak, f"predict_memory ({r.predicted.phase})"


def _row(r) -> dict:
    tensors, source = _tensors(r)
    step = [o for o in r.fit.lines if o.alive != "load"]
    return {"plan": r.candidate.describe(), "levers": r.candidate.techniques(),
            "gpu_bytes": r.fit.total,
            "checked": "replayed" if r.fit.how == "replayed" else "predicted",
            "fits": r.fit.fits if r.fit.how != "predicted" else None,   # unchecked: null
            "memory_lines": [{"name": "tensors at the peak", "bytes": tensors, "source": source}]
            + [{"name": o.name, "bytes": o.bytes, "source": o.source} for o in step],
            "load_bytes": r.fit.load,
            "host_bytes": r.predicted.host, "disk_bytes": r.predicted.disk,
            "seconds": r.seconds}


def plan_dict(result, *, top: int = 10) -> dict:
    """The plans that fit, fastest first, as JSON-ready data."""
    config = getattr(result, "config", None)
    return {"model": config.name if config else None, "n_params": result.n_params,
            "gpu": result.gpu.name if result.gpu else None, "gpus": result.world_size,
            "batch_sequences": result.batch, "seq_len": result.shape.seq_len if result.shape else None,
            "budget": result.budget, "chosen": _row(result.chosen_row),
            "plans": [_row(r) for r in result.shown[:top]],
            "failed_when_simulated": [r.candidate.describe() for r in result.failed],
            "not_known": list(NOT_KNOWN)}


# What a plan's lines cannot see: printed under every plan, so that "fits" is not read as a promise
NOT_KNOWN = ("Not counted: kernels' own scratch beyond these lines (cuDNN, NCCL's algorithms, "
             "a library's workspace), other processes on the GPU,",
             "and allocator changes in other PyTorch versions or settings (expandable_segments, "
             "torch.compile, CUDA graphs). Keep a margin (--budget) for them.")


def format_plans(result, *, top: int = 5) -> str:
    """The table, then the `top` fastest plans (`Plan.shown`, each replayed through the
    allocator) with their memory lines, which add up to the total, and time parts."""
    out, sources = [result.table(limit=top), ""], {}
    for r in result.failed:
        if r.fit.how == "replayed":
            out.append(f"Predicted to fit, but its simulated step does not when replayed "
                       f"through the allocator: {r.candidate.describe()} "
                       f"({r.fit.lines[-1].source}).")
        else:
            out.append(f"Predicted to fit, but its simulated step needs "
                       f"{format_bytes(r.fit.total)}: {r.candidate.describe()}.")
    for i, r in enumerate(result.shown[:top], 1):
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in r.seconds.items()
                          if k not in ("total", "communication hidden") and v)
        if r.seconds.get("communication hidden"):
            parts += (f"; besides, {r.seconds['communication hidden']:.2f}s of communication "
                      "hidden behind compute")
        out.append(f"{i}. {r.candidate.describe()}: step {r.seconds['total']:.2f} s ({parts})")
        tensors, _ = _tensors(r)
        how = (r.fit.how if r.fit.how in ("replayed", "simulated") else
               "predicted, not replayed: unchecked" if result.device.type == "cuda" else
               "interpolated, not simulated" if result.shape is None else
               "predicted, not simulated")
        where = "GPU memory" if result.device.type == "cuda" else "memory"
        out.append(f"   {where} {format_bytes(r.fit.total)} of {format_bytes(result.budget)}"
                   f" ({how}): tensors {format_bytes(tensors)} at the "
                   f"{r.phase} phase"
                   + (f" (predicted {format_bytes(r.predicted.peak)})"
                      if tensors != r.predicted.peak else ""))
        out += [f"     {o.name}: {format_bytes(o.bytes)}" for o in r.fit.lines
                if o.alive != "load"]
        for o in r.fit.lines:
            if o.alive == "load":
                out.append(f"   at load, before the step: {format_bytes(r.fit.load)} with the "
                           f"{o.name.removesuffix(' (load)')} ({format_bytes(o.bytes)})"
                           + (", the peak" if r.fit.load >= r.fit.total else ""))
        sources.update({o.name: o.source for o in r.fit.lines})
        if r.predicted.host:
            out.append(f"   host {format_bytes(r.predicted.host)}"
                       + (f", disk {format_bytes(r.predicted.disk)}" if r.predicted.disk else ""))
    if sources:
        out.append("Where the lines come from:")
        out += [f"  {name}: {source}" for name, source in sources.items()]
    if result.gpu is not None and result.budget == result.gpu.usable_bytes:
        out.append(f"  the budget: the {result.gpu.name}'s total as CUDA reports it "
                   f"({format_bytes(result.gpu.memory_bytes)} nominal): "
                   f"{result.gpu.usable_source}")
    if result.device.type == "cuda":
        out += list(NOT_KNOWN)
        if result.world_size > 1 and any(r.candidate.zero_stage == 3
                                         for r in result.shown[:top]):
            whole = result.shape.n_params * 4 if result.shape else None
            out.append("ZeRO-3 plans assume the model is made on the meta device and each GPU "
                       "makes only its shards (FSDP2's way: fully_shard, then to_empty and "
                       "init, as torchtitan does); made whole on one GPU first, it needs "
                       + (f"{format_bytes(whole)} (fp32) " if whole else "its whole size ")
                       + "while it loads.")
    out.append("Not searched: tensor and pipeline parallelism, nor context parallelism, on this "
               "path (one layer must fit one GPU); --gpus-per-node plans a Llama with them.")
    if result.shape is None:
        out.append("Not searched for a traced model: ZeRO, offload, chunked loss, QLoRA (the "
                   "course's own training loop runs those; `known.Traced`).")
    elif result.shape.llama:
        out += ["Not searched for a Llama:"] + [f"  {why}" for why in LLAMA_NOT_SEARCHED]
    return "\n".join(out)
