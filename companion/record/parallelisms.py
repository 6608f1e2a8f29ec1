"""Chapter 13's recorded run: tensor (and sequence), context and pipeline parallelism on real ranks.

`parallelisms(S, device)` runs `companion.parallel_runs`' comparisons on the ranks
`record.parallel.ranks` gives: on a machine with 2 or more GPUs, one rank per GPU under NCCL (a
power of two of them, at most 4, so that heads, widths and sequences divide); on the CPU, 2 gloo
ranks. One GPU cannot hold two NCCL ranks, so there the split runs are left out and the record
says so (`ran`); what one GPU measures honestly is what one rank holds, its collectives on a group
of one (`record.alone.block_shard_alone`, `ring_shard_alone`): a t-way tensor-parallel share of
a block (weights, bytes kept for backward, peak) against `tensor_parallel`'s formulas, and one
context-parallel rank's kept bytes against full attention over the whole sequence. Every machine
records those too, so that the CPU run tests the one-GPU path.

`figures(blocks, attentions, pipelines, ...)` and `predictions(...)` turn the runs into the
recorder's measured and predicted values, under the names the notebook's `compare("13", ...)`
uses.

Example:
    >>> out = parallelisms(sizes("cpu"), torch.device("cpu"), repeats=1)
    >>> out["measured"]["block_tp2_error"], out["measured"]["ran"]
"""
from __future__ import annotations

import statistics

import torch

from companion import context_parallel as cp, launch, models, tensor_parallel as tp
from companion import parallel_runs as pr
from companion.pipeline import schedules
from companion.record import alone as one_rank
from companion.record.parallel import ranks
from companion.results import curve

__all__ = ["usable_ranks", "block_case", "attention_case", "pipeline_case", "alone_runs",
           "figures", "predictions", "parallelisms"]


def usable_ranks(world: int) -> int:
    """The largest power of two at most `world` (and at most 4): 3 GPUs run 2 ranks, so that the
    heads, widths and sequences of the sizes divide."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    return min(4, 1 << (world.bit_length() - 1))


def block_case(S) -> tuple:
    """The chapter's block (written-out attention) and its input and output gradient, on the CPU."""
    torch.manual_seed(0)
    block = models.Block(S.tp_width, S.tp_heads)
    g = torch.Generator().manual_seed(1)
    shape = (S.tp_batch, S.tp_seq, S.tp_width)
    return block, torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def attention_case(S) -> tuple:
    """q, k, v and the output's gradient, (B, H, T, d) each, on the CPU."""
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randn(S.cp_batch, S.cp_heads, S.cp_len, S.cp_head_dim, generator=g)
                 for _ in range(4))


def pipeline_case(S) -> tuple:
    """The pipeline's MLP (an nn.Sequential), its micro-batches and their targets, on the CPU."""
    model = models.MLP(S.pp_width, S.pp_width, S.pp_depth, 10, seed=0).net
    g = torch.Generator().manual_seed(3)
    xs = list(torch.randn(S.pp_micro_batches, S.pp_batch, S.pp_width, generator=g).unbind())
    ys = list(torch.randint(10, (S.pp_micro_batches, S.pp_batch), generator=g).unbind())
    return model, xs, ys


def alone_runs(S, backend: str, *, ts=(1, 2, 4), ks=(2, 4), timeout: float = 600.0) -> dict:
    """One rank alone (a process group of one, on the device `backend` gives it): rank 0's share
    of a t-way split block for each t of `ts` that divides the heads, and the first of k shards of
    the attention for each k of `ks` that divides T, with full attention beside them."""
    block, x, g = block_case(S)
    ts = [t for t in ts if S.tp_heads % t == 0 and S.tp_width % t == 0]
    ks = [k for k in ks if S.cp_len % k == 0]
    tensors = attention_case(S)
    return {"tp": launch.run(one_rank.block_shard_alone, 1, block, x, g, ts, backend=backend,
                             timeout=timeout)[0],
            "tp_shape": (S.tp_batch, S.tp_seq, S.tp_width, S.tp_heads),
            "cp": launch.run(one_rank.ring_shard_alone, 1, tensors, ks, backend=backend,
                             timeout=timeout)[0],
            "cp_shape": tuple(tensors[0].shape)}


def _key(run) -> str:
    if isinstance(run, pr.BlockRun):
        return f"block_tp{run.world}" + ("_sp" if run.sequence_parallel else "")
    if isinstance(run, pr.AttentionRun):
        return f"attention_{run.method}{run.world}" + (
            "" if run.layout == "contiguous" else f"_{run.layout}")
    return f"pipeline_{run.name or 'schedule'}_p{run.stages}_m{run.micro_batches}"


def figures(blocks: list, attentions: list, pipelines: list, *, alone: dict | None = None,
            steps: dict | None = None) -> dict:
    """The measured values of `parallel_runs`' BlockRun, AttentionRun and PipelineRun lists (bytes
    per rank: the largest over the ranks), of `alone_runs`' dict, and of `steps` ({name: seconds
    per round}, the slowest rank's), as the recorder writes them and `compare` shows them."""
    out = {}
    for run in (*blocks, *attentions):             # both: error, (forward, backward) sent, kept
        k = _key(run)
        out[f"{k}_error"] = run.error
        out[f"{k}_sent_forward_bytes"] = max(f for f, _ in run.sent)
        out[f"{k}_sent_backward_bytes"] = max(b for _, b in run.sent)
        out[f"{k}_kept_bytes"] = max(run.kept)
    for run in blocks:
        out["block_whole_kept_bytes"] = run.whole_kept
    for run in pipelines:
        k = _key(run)
        out[f"{k}_error"] = run.error
        out[f"{k}_first_stage_peak_activation_bytes"] = run.peak_activation_bytes[0]
        out[f"{k}_stage_peak_activation_bytes"] = curve(
            range(run.stages), run.peak_activation_bytes, xlabel="stage",
            ylabel="bytes saved for backward at the peak",
            title=f"{run.name}: activations per stage (p={run.stages}, m={run.micro_batches})")
        out[f"{k}_bubble"] = run.bubble
        out[f"{k}_forward_seconds"] = run.forward_s
        out[f"{k}_backward_seconds"] = run.backward_s
    for name, seconds in (steps or {}).items():
        out[f"{name}_step_seconds"] = statistics.median(seconds)
    if alone:
        ts = sorted(alone["tp"])
        for t in ts:
            for what in ("weights", "kept", "peak"):
                out[f"tp_shard_t{t}_{what}_bytes"] = alone["tp"][t][what]
        out["tp_shard_kept_bytes_by_t"] = curve(
            ts, [alone["tp"][t]["kept"] for t in ts], xlabel="tensor-parallel ranks t",
            ylabel="bytes kept for backward, one rank", title="A block's share on one rank")
        ks = sorted(alone["cp"])                        # 0: full attention over the whole T
        for k in ks:
            name = "full_attention" if k == 0 else f"cp_shard_k{k}"
            out[f"{name}_kept_bytes"] = alone["cp"][k]["kept"]
            out[f"{name}_peak_bytes"] = alone["cp"][k]["peak"]
        out["cp_shard_kept_bytes_by_k"] = curve(
            [max(k, 1) for k in ks], [alone["cp"][k]["kept"] for k in ks],
            xlabel="context-parallel ranks k (1: full attention)",
            ylabel="bytes kept after forward, one rank", title="Attention on one rank of k")
    return out


def _weights_formula(h: int, t: int) -> int:
    """fp32 bytes of rank 0's share of a Block: qkv 3h²/t + 3h/t, proj h²/t + h (bias whole),
    fc 4h²/t + 4h/t, out 4h²/t + h, the two LayerNorms 4h."""
    return 4 * (12 * h * h // t + 7 * h // t + 6 * h)


def predictions(blocks: list, attentions: list, pipelines: list, *,
                alone: dict | None = None) -> dict:
    """The formulas' values under `figures`' names: bytes sent and kept (`tensor_parallel`,
    `context_parallel`), per-stage peaks from the schedule's simulation, and the bubble the
    simulator gives on the measured forward and backward times."""
    out = {}
    for run in blocks:
        k = _key(run)
        out[f"{k}_sent_forward_bytes"], out[f"{k}_sent_backward_bytes"] = run.sent_formula
        out[f"{k}_kept_bytes"] = run.kept_formula
    for run in attentions:
        k = _key(run)
        out[f"{k}_sent_forward_bytes"], out[f"{k}_sent_backward_bytes"] = run.sent_formula
        if run.kept_formula is not None:
            out[f"{k}_kept_bytes"] = run.kept_formula
    for run in pipelines:
        k = _key(run)
        out[f"{k}_first_stage_peak_activation_bytes"] = run.predicted_peak[0]
        out[f"{k}_stage_peak_activation_bytes"] = curve(
            range(run.stages), run.predicted_peak, xlabel="stage",
            ylabel="bytes saved for backward at the peak")
        out[f"{k}_bubble"] = run.bubble_at_measured
        out[f"{k}_bubble_formula"] = run.bubble_formula
    if alone:
        b, s, h, a = alone["tp_shape"]
        ts = sorted(alone["tp"])
        for t in ts:
            out[f"tp_shard_t{t}_weights_bytes"] = _weights_formula(h, t)
            out[f"tp_shard_t{t}_kept_bytes"] = tp.tp_activation_bytes(b, s, h, a, t)
        out["tp_shard_kept_bytes_by_t"] = curve(
            ts, [tp.tp_activation_bytes(b, s, h, a, t) for t in ts],
            xlabel="tensor-parallel ranks t", ylabel="bytes kept for backward, one rank")
        B, H, T, d = alone["cp_shape"]
        ks = sorted(alone["cp"])
        kept = {k: cp.ring_kept_bytes((B, H, T // max(k, 1), d), torch.float32) for k in ks}
        for k in ks:
            out["full_attention_kept_bytes" if k == 0 else f"cp_shard_k{k}_kept_bytes"] = kept[k]
        out["cp_shard_kept_bytes_by_k"] = curve(
            [max(k, 1) for k in ks], [kept[k] for k in ks],
            xlabel="context-parallel ranks k (1: full attention)",
            ylabel="bytes kept after forward, one rank")
    return out


def _slowest(per_rank: list[dict]) -> dict[str, list[float]]:
    """{name: seconds per round}, each round's slowest rank (a step ends when every rank has)."""
    return {name: [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))]
            for name in per_rank[0]}


def parallelisms(S, device: torch.device, *, repeats: int = 3) -> dict:
    """The recorded run: on 2 or more ranks, the block split by tensor parallelism with and
    without sequence parallelism, ring (zigzag) and Ulysses attention, GPipe and 1F1B, each
    against its one-process reference on the CPU, and ring attention's step beside full
    attention's on each rank's device; on every machine, one rank alone (`alone_runs`)."""
    world, backend = ranks(device)
    n = usable_ranks(world)
    timeout = 600.0
    blocks, attentions, pipelines, steps = [], [], [], {}
    if n >= 2:
        block, x, g = block_case(S)
        blocks = [pr.compare_block(block, x, g, n, sequence_parallel=sp, backend=backend,
                                   timeout=timeout) for sp in (False, True)]
        tensors = attention_case(S)
        attentions = [pr.compare_attention(*tensors, n, method=method, layout=layout,
                                           backend=backend, timeout=timeout)
                      for method, layout in (("ring", "zigzag"), ("ulysses", "contiguous"))]
        per_rank = launch.run(one_rank.attention_step_seconds, n, "ring", tensors, True, "zigzag",
                              max(1, repeats), backend=backend, timeout=timeout)
        times = _slowest(per_rank)
        steps = {"attention_full": times["full"], f"attention_ring{n}_zigzag": times["ring"]}
        model, xs, ys = pipeline_case(S)
        pipelines = [pr.compare_pipeline(model, xs, ys, make(n, len(xs)), name=name,
                                         backend=backend, timeout=timeout)
                     for name, make in (("gpipe", schedules.gpipe),
                                        ("1f1b", schedules.one_f_one_b))]
    alone = alone_runs(S, backend, timeout=timeout)
    where = "the CPU" if device.type == "cpu" else "GPU 0"
    if n >= 2:
        each = "CPU processes" if device.type == "cpu" else "one GPU each"
        ran = (f"split runs on {n} {backend} ranks ({each}), their references in one process "
               f"on the CPU; one rank alone on {where}")
    else:
        ran = (f"one GPU: no split runs (NCCL cannot put two ranks on one GPU); one rank alone "
               f"on {where}, its collectives on a group of one (nothing sent, so no error and "
               "no traffic measured): memory only")
    measured = figures(blocks, attentions, pipelines, alone=alone, steps=steps)
    measured.update(world_size=world, ranks_used=n, backend=backend, ran=ran)
    return {"experiment": "a block split by tensor (and sequence) parallelism, ring and Ulysses "
                          "attention, GPipe and 1F1B, each against one process; one rank's "
                          "memory alone",
            "measured": measured,
            "predicted": predictions(blocks, attentions, pipelines, alone=alone)}
