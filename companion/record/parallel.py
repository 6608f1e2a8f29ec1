"""Recorded experiments of data parallelism on real ranks: DataParallel, DDP, ZeRO.

On CUDA the ranks are the machine's GPUs under NCCL (up to 4; one GPU gives one rank, and then
nothing is sharded: the record says so with its world size); on the CPU, 2 gloo ranks. Each
experiment returns {"experiment", "measured", "predicted"} (see `companion.results`).

Example:
    >>> out = zero(sizes("cpu"), torch.device("cpu"), repeats=1)
    >>> out["measured"]["model_states_over_formula"]["y"]      # ~1.0 at every stage
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from companion import cost, ddp, dp, launch
from companion.results import curve
from companion.zero import experiments

__all__ = ["ranks", "data_parallel", "dp_figures", "calibration_figures", "zero", "stage_figures",
           "fsdp_figures"]


def ranks(device: torch.device) -> tuple[int, str]:
    """(world size, backend) for the recorded multi-process runs on `device`'s kind."""
    if device.type == "cuda":
        return min(torch.cuda.device_count(), 4), "nccl"
    return 2, "gloo"


def dp_figures(reports: dict) -> dict:
    """{N: `dp.StepReport`} -> what DataParallel's master holds beyond a replica, against N."""
    ns = sorted(reports)
    last = reports[ns[-1]]
    return {"dp_master_extra_over_replica": curve(
                ns, [reports[n].master_extra_bytes / reports[n].replica_bytes[0] for n in ns],
                xlabel="replicas N", ylabel="master's extra bytes / a replica's",
                title="DataParallel: the master's extra over a replica"),
            f"dp_master_extra_N{ns[-1]}_bytes": last.master_extra_bytes,
            f"dp_replica_N{ns[-1]}_bytes": last.replica_bytes[0]}


def data_parallel(S, device: torch.device, *, repeats: int = 3) -> dict:
    """DataParallel's master on one device against N = 1, 2, 4 replicas (`dp.DataParallel`), and
    a DDP step, ours against torch's DistributedDataParallel (`ddp.time_training_step`), with the
    bytes all-reduced per step against the gradient bytes."""
    reports = {}
    for n in (1, 2, 4):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(S.depth // 2)
                                for m in (nn.Linear(S.width, S.width), nn.ReLU())]).to(device)
        x, y = (torch.randn(4 * S.batch, S.width, device=device) for _ in range(2))
        parallel = dp.DataParallel(model, n_replicas=n)
        parallel.train_step(x, y, F.mse_loss, torch.optim.SGD(model.parameters(), lr=1e-3))
        reports[n] = parallel.last_report
    grad_bytes = sum(p.nbytes for p in model.parameters())
    del model, parallel
    measured = dp_figures(reports)
    rows_bytes = 2 * x.nbytes                                   # the batch and its targets
    predicted = {"dp_master_extra_N4_bytes": rows_bytes + max(2 * x.nbytes, grad_bytes)}
    world, backend = ranks(device)
    steps = {impl: launch.run(ddp.time_training_step, world, impl, S.width, S.depth // 2, S.batch,
                              max(1, repeats), backend=backend, timeout=600)
             for impl in ("ours", "torch")}
    seconds = {impl: max(r["seconds"] for r in out) for impl, out in steps.items()}
    measured.update(ddp_world_size=world, ddp_backend=backend,
                    ddp_ours_step_seconds=seconds["ours"], ddp_torch_step_seconds=seconds["torch"],
                    ddp_ours_over_torch=seconds["ours"] / seconds["torch"],
                    ddp_all_reduce_bytes=steps["ours"][0]["all_reduce_bytes"])
    predicted["ddp_all_reduce_bytes"] = grad_bytes               # every gradient, once per step
    profile = cost.calibrate(device, threads=None if device.type == "cuda" else 1, repeats=3)
    measured.update(calibration_figures(profile, device))
    layers = cost.mlp_layers(S.width, S.depth // 2, S.batch)
    predicted["ddp_ours_step_seconds"] = cost.ddp_step(layers, profile.speeds(), world).total
    return {"experiment": "DataParallel's master; a DDP step, ours against torch's and against "
            "companion.cost's prediction; the device calibrated",
            "measured": measured, "predicted": predicted}


def calibration_figures(profile: "cost.DeviceProfile", device: torch.device) -> dict:
    """`cost.calibrate`'s medians as a record's numbers, and on a GPU of `cost.gpus`' table the
    fraction of its datasheet's fp32 and bf16 peaks that the best timed matmul reached: the
    figure the table's cited efficiency factors are waiting for."""
    pinned = (profile.host_to_device or {}).get("pinned")
    pageable = (profile.host_to_device or {}).get("pageable")
    bf16 = profile.peak_flops("bfloat16") if profile.matmul.get("bfloat16") else None
    out = {"calibrate_fp32_peak_flops": profile.peak_flops("float32"),
           "calibrate_bf16_peak_flops": bf16,
           "calibrate_copy_bandwidth": profile.copy_bandwidth.median,
           "calibrate_h2d_pinned_bandwidth": pinned.median if pinned else None,
           "calibrate_h2d_pageable_bandwidth": pageable.median if pageable else None,
           "calibrate_host_adamw_params_per_second": max(m.median for m in profile.adamw.values()),
           "calibrate_gloo_alpha_seconds": profile.alpha.median if profile.alpha else None,
           "calibrate_seconds": profile.seconds}
    table = cost.gpus.gpu_for_device(device) if device.type == "cuda" else None
    if table is not None:
        out["gpu_fp32_fraction_of_datasheet"] = out["calibrate_fp32_peak_flops"] / table.fp32_flops
        if bf16 and table.bf16_flops:
            out["gpu_bf16_fraction_of_datasheet"] = bf16 / table.bf16_flops
    return out


def stage_figures(per_rank: list, world: int) -> dict:
    """Rank 0's `zero.experiments.stage_report` -> model states per stage, their ratio to the
    formula (`predicted_model_states`) and, on 2 or more ranks, bytes sent per step over an
    all-reduce's share ((N-1)/N·4Ψ)."""
    stages = per_rank[0]
    out, ratios = {}, []
    for r in stages:
        whole = r["n_replicated"] if r["stage"] == 3 else 0          # FSDP keeps 1-D ones whole
        want = experiments.predicted_model_states(r["n_params"] - whole, whole,
                                                  stage=r["stage"], world_size=world)
        have = r["params"] + r["grads"] + r["optimizer_state"]
        out[f"stage{r['stage']}_model_states_bytes"] = have
        ratios.append(have / want.total)
    out["model_states_over_formula"] = curve(
        [r["stage"] for r in stages], ratios, xlabel="ZeRO stage (0: DDP)",
        ylabel="measured / formula", title="Model states of rank 0")
    if world > 1:
        unit = (world - 1) / world * 4 * stages[0]["n_params"]
        out["traffic_over_all_reduce_share"] = curve(
            [r["stage"] for r in stages], [r["sent_bytes"] / unit for r in stages],
            xlabel="ZeRO stage (0: DDP)", ylabel="sent per rank / ((N-1)/N·4Ψ)",
            title="Traffic per rank per step")
    return out


def fsdp_figures(versus: list) -> dict:
    """Every rank's `zero.experiments.fsdp_comparison` -> step time (slowest rank) and rank 0's
    model states, ours and FSDP2's."""
    out = {}
    for impl, name in (("ours", "fsdp_ours"), ("torch", "fsdp2")):
        out[f"{name}_step_seconds"] = max(r[impl]["seconds"] for r in versus)
        out[f"{name}_model_states_bytes"] = sum(versus[0][impl][k] for k in
                                                ("params", "grads", "optimizer_state"))
    return out


def zero(S, device: torch.device, *, repeats: int = 3) -> dict:
    """ZeRO stages 0-3 on the ranks (`zero.experiments.stage_report`): model states per rank
    against the formula, traffic against 2Ψ/2Ψ/3Ψ; our FSDP against FSDP2
    (`fsdp_comparison`): step time and model states."""
    world, backend = ranks(device)
    per_rank = launch.run(experiments.stage_report, world, [0, 1, 2, 3], S.zero_width,
                          S.zero_depth, S.zero_batch, backend=backend, timeout=600)
    measured = stage_figures(per_rank, world)
    measured["zero_world_size"] = world
    stages = per_rank[0]
    predicted = {"model_states_over_formula": dict(measured["model_states_over_formula"],
                                                   y=[1.0] * len(stages))}
    for r in stages:
        whole = r["n_replicated"] if r["stage"] == 3 else 0
        predicted[f"stage{r['stage']}_model_states_bytes"] = experiments.predicted_model_states(
            r["n_params"] - whole, whole, stage=r["stage"], world_size=world).total
    if world > 1:
        predicted["traffic_over_all_reduce_share"] = dict(
            measured["traffic_over_all_reduce_share"], y=[2, 2, 2, 3 - 1 / S.zero_depth])
    versus = launch.run(experiments.fsdp_comparison, world, S.zero_width, S.zero_depth,
                        S.zero_batch, max(1, repeats), backend=backend, timeout=600)
    measured.update(fsdp_figures(versus))
    return {"experiment": "ZeRO stages 0-3 per rank; our FSDP against FSDP2",
            "measured": measured, "predicted": predicted}
