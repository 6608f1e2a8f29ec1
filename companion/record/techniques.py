"""Recorded experiments of the techniques on one device: checkpointing, mixed precision, offload.

Each experiment returns {"experiment", "measured", "predicted"} (see `companion.results`). The
`*_figures` functions turn raw measurements into the recorded names, so a notebook hands its own
measurements to them and `companion.results.compare` sets them beside a GPU's.

Example:
    >>> out = checkpoint_segments(sizes("cpu"), torch.device("cpu"), repeats=1)
    >>> out["measured"]["mlp_saved_units"]["y"]          # saved peak per segment count, in layers
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from companion import amp, checkpointing, estimate
from companion.checkpointing import checkpoint_sequential, profile_segments
from companion.memory import track
from companion.models import GPT, MLP, Block, make_tokens
from companion.offload import CPUOffloadOptimizer, step_phases
from companion.record.common import median_seconds
from companion.results import curve

__all__ = ["checkpoint_segments", "segment_figures", "attention_figures", "mixed_precision",
           "layout_figures", "loss_figures", "train_losses", "LOSS_RUNS", "offload",
           "offload_figures"]


def segment_figures(name: str, runs: list, unit: int) -> dict:
    """`profile_segments` runs as curves: the saved peak in units of one layer's activations
    (`unit` bytes), and the step time over the time without checkpointing."""
    s = [r.segments for r in runs]
    return {f"{name}_saved_units": curve(s, [r.activation_bytes / unit for r in runs],
                                         xlabel="segments s", ylabel="saved peak / one layer",
                                         title=f"{name}: activations at the peak", xscale="log"),
            f"{name}_time_ratio": curve(s, [r.seconds / runs[0].seconds for r in runs],
                                        xlabel="segments s", ylabel="step time / no checkpointing",
                                        title=f"{name}: time", xscale="log")}


def attention_figures(attention_bytes: dict[int, tuple[int, int]]) -> dict:
    """{T: (written-out bytes, fused bytes)} saved by one block as a curve of their ratio."""
    lengths = sorted(attention_bytes)
    return {"attention_written_over_fused": curve(
        lengths, [attention_bytes[T][0] / attention_bytes[T][1] for T in lengths],
        xlabel="sequence length T", ylabel="bytes saved: written-out / fused",
        title="One block: written-out attention against SDPA", xscale="log")}


def _mlp_segments(S, device: torch.device, repeats: int) -> tuple[list, int, list[int]]:
    """Chapter 04's deep MLP profiled: (runs, one block's activation bytes, segment counts)."""
    mlp = MLP(S.width, S.width, S.ckpt_depth, 10, device=device)
    blocks = [mlp.net[i:i + 2] for i in range(0, 2 * S.ckpt_depth, 2)]     # (Linear, ReLU)
    x = torch.randn(S.ckpt_batch, S.width, device=device)
    y = torch.randint(10, (S.ckpt_batch,), device=device)

    def step(segments: int) -> None:
        F.cross_entropy(mlp.net[-1](checkpoint_sequential(blocks, segments, x)), y).backward()

    counts = [s for s in (1, 2, 4, 8, 16, 32, 64) if s <= S.ckpt_depth]
    runs = profile_segments(step, counts, device=device, repeats=repeats)
    return runs, S.ckpt_batch * S.width * 4, counts                     # unit: one block's output


def _gpt_segments(S, device: torch.device, repeats: int) -> tuple[list, int, list[int], Block]:
    """Chapter 04's GPT stack profiled: (runs, one block's saved bytes, counts, its first block)."""
    gpt = GPT(S.vocab, S.seq_len, S.gpt_width, S.ckpt_gpt_depth, S.gpt_heads, device=device)
    tokens, targets = (t.to(device) for t in make_tokens(S.ckpt_gpt_batch, S.seq_len,
                                                          vocab=S.vocab))
    positions = torch.arange(S.seq_len, device=device)

    def step(segments: int) -> None:
        hidden = gpt.tok(tokens) + gpt.pos(positions)                     # (B, T, C)
        hidden = checkpoint_sequential(list(gpt.blocks), segments, hidden)
        logits = gpt.head(gpt.ln(hidden))                                 # (B, T, vocab)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    counts = [s for s in (1, 2, 4, 8, 16) if s <= S.ckpt_gpt_depth]
    runs = profile_segments(step, counts, device=device, repeats=repeats)
    h = torch.randn(S.ckpt_gpt_batch, S.seq_len, S.gpt_width, device=device, requires_grad=True)
    return runs, checkpointing.activation_bytes(gpt.blocks[0], h), counts, gpt.blocks[0]


def checkpoint_segments(S, device: torch.device, *, repeats: int = 3) -> dict:
    """Saved peak and step time against the segment count (`profile_segments` over
    `checkpoint_sequential`) for the deep MLP and the GPT stack, against the √n theory; and what
    one block saves with written-out attention against `F.scaled_dot_product_attention`."""
    mlp_runs, unit, counts = _mlp_segments(S, device, repeats)
    gpt_runs, gpt_unit, gpt_counts, block = _gpt_segments(S, device, repeats)
    fused = Block(S.gpt_width, S.gpt_heads, fused_attention=True).to(device)
    fused.load_state_dict(block.state_dict())
    attention = {}
    for T in (S.seq_len // 2, S.seq_len, 2 * S.seq_len, 4 * S.seq_len):
        xt = torch.randn(1, T, S.gpt_width, device=device, requires_grad=True)
        attention[T] = (checkpointing.activation_bytes(block, xt),
                        checkpointing.activation_bytes(fused, xt))
    measured = (segment_figures("mlp", mlp_runs, unit) | segment_figures("gpt", gpt_runs, gpt_unit)
                | attention_figures(attention))
    measured.update(mlp_step_peak_bytes=mlp_runs[0].peak_bytes, mlp_unit_bytes=unit,
                    gpt_unit_bytes=gpt_unit, gpt_step_peak_bytes=gpt_runs[0].peak_bytes)
    c = S.ckpt_gpt_batch * S.seq_len * S.gpt_width * 4                      # one block's input
    predicted = {}
    for name, n, ks, u, cb in (("mlp", S.ckpt_depth, counts, unit, None),
                               ("gpt", S.ckpt_gpt_depth, gpt_counts, gpt_unit, c)):
        predicted[f"{name}_saved_units"] = dict(measured[f"{name}_saved_units"], y=[
            checkpointing.predicted_activation_bytes(n, k, u, cb) / u for k in ks])
        predicted[f"{name}_time_ratio"] = dict(measured[f"{name}_time_ratio"], y=[
            checkpointing.predicted_time_ratio(n, k) for k in ks])
    return {"experiment": "checkpoint_sequential: memory and time against the segment count",
            "measured": measured, "predicted": predicted}


# ---------------------------------------------------------------- mixed precision

LOSS_RUNS = {"fp32": (None, False), "bf16 autocast": (torch.bfloat16, False),
             "fp16 + GradScaler": (torch.float16, True), "fp16, no scaler": (torch.float16, False)}


_MASTER_GRADS = {"master": "16-bit", "main_grad": "main_grad", "both_grads": "both"}
LAYOUTS = {"fp32": ("fp32", {}), "autocast": ("autocast", {}), "master": ("mixed", {}),
           "main_grad": ("mixed", {"fp32_grads": True}),
           "both_grads": ("mixed", {"fp32_grad_buffer": True}), "bf16": ("bf16", {})}


def _two_steps(S, layout: str, device: torch.device):
    """Chapter 05's layouts: two forward/backward passes of the GPT with one Adam step between."""
    low = torch.bfloat16
    x, y = (t.to(device) for t in make_tokens(S.amp_gpt_batch, S.seq_len, vocab=S.vocab))
    with track(device) as t:
        model = GPT(S.vocab, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads, device=device,
                    dtype=torch.float32 if layout in ("fp32", "autocast") else low)
        grads = _MASTER_GRADS.get(layout)
        master = amp.MasterWeights(model.parameters(), grads=grads) if grads else None
        opt = torch.optim.Adam(master.master_params if master else model.parameters(), lr=1e-3)
        for i in range(2):
            with torch.autocast(device.type, dtype=low, enabled=layout == "autocast"):
                loss = model.loss(x, y)
            loss.backward()
            if i == 1:
                break                             # the second backward's gradients stay
            if master is not None:
                master.step(opt)                  # fp32 step on the masters, copied back
            else:
                opt.step()
            model.zero_grad(set_to_none=True)
    return t, sum(p.numel() for p in model.parameters())


def layout_figures(runs: dict) -> dict:
    """{layout: (tracker, n_params)} of chapter 05's layouts -> model-state bytes per parameter
    live at the end of the second backward, and the step's peak."""
    out = {}
    for layout, (tracker, n) in runs.items():
        end = tracker.breakdown("current")
        parts = sum(end[k] for k in ("parameters", "gradients", "optimizer_state"))
        out[f"{layout}_bytes_per_param"] = parts / n
        out[f"{layout}_step_peak_bytes"] = tracker.peak
    return out


def train_losses(S, X: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None, *, scaled: bool,
                 divide: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Losses and loss scales of S.amp_steps Adam steps of the MLP (amp_width, amp_depth) on
    batches of S.amp_batch rows of (X, y), autocast to `dtype` (None: fp32), loss / `divide`."""
    model = MLP(X.shape[1], S.amp_width, S.amp_depth, int(y.max()) + 1, device=device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = amp.GradScaler(device.type, growth_interval=10, enabled=scaled)
    g = torch.Generator().manual_seed(1)
    losses, scales = [], []
    for _ in range(S.amp_steps):
        idx = torch.randint(len(X), (S.amp_batch,), generator=g).to(device)
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model.loss(X[idx], y[idx])
        opt.zero_grad(set_to_none=True)
        scales.append(scaler.get_scale())
        scaler.scale(loss / divide).backward()
        scaler.step(opt)                                  # skipped when a gradient is inf/NaN
        scaler.update()
        losses.append(loss.item())                        # host-device sync
    return losses, scales


def loss_figures(curves: dict[str, tuple[list[float], list[float]]], *, window: int = 10) -> dict:
    """{run name: (losses, scales)} -> the loss of each run in `LOSS_RUNS`, a running mean of
    `window` steps, as curves, and the steps the fp16 run's GradScaler skipped (its scale fell)."""
    out = {}
    if "fp16 + GradScaler" in curves:
        scales = curves["fp16 + GradScaler"][1]
        out["fp16_steps_skipped"] = sum(b < a for a, b in zip(scales, scales[1:]))
    for name in LOSS_RUNS:
        if name in curves:
            losses = torch.tensor(curves[name][0])
            smooth = losses.unfold(0, window, 1).mean(1) if len(losses) >= window else losses
            key = "loss_" + "_".join(name.lower().replace("+", " ").replace(",", " ").split())
            out[key] = curve(range(len(losses) - len(smooth), len(losses)), smooth.tolist(),
                             xlabel="step", ylabel=f"loss (mean of {window} steps)",
                             title=f"MLP training: {name}")
    return out


def mixed_precision(S, device: torch.device, *, repeats: int = 3) -> dict:
    """Chapter 05 on the device: model-state bytes per parameter in six layouts, the activations
    autocast saves against fp32, 16-bit matmul and GPT-step speed against fp32, and the loss
    curves of the MLP trained in fp32, bf16 and fp16 with and without a GradScaler."""
    runs = {layout: _two_steps(S, layout, device) for layout in LAYOUTS}
    n = runs["fp32"][1]
    measured = layout_figures(runs)
    predicted = {f"{layout}_bytes_per_param": estimate.model_states(n, precision=p, **o).total / n
                 for layout, (p, o) in LAYOUTS.items()}
    gpt = GPT(S.vocab, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads, device=device)
    x, y = (t.to(device) for t in make_tokens(S.amp_gpt_batch, S.seq_len, vocab=S.vocab))
    saved = {}
    for on in (False, True):
        with track(device) as t, torch.autocast(device.type, dtype=torch.bfloat16, enabled=on):
            loss = gpt.loss(x, y)
        saved[on] = t.current - loss.untyped_storage().nbytes()
    shape = (S.amp_gpt_batch, S.seq_len, S.gpt_width, S.gpt_depth, S.gpt_heads, S.vocab)
    measured["autocast_over_fp32_activations"] = saved[True] / saved[False]
    predicted["autocast_over_fp32_activations"] = estimate.gpt_activations(
        *shape, precision="autocast", device_type=device.type) / estimate.gpt_activations(*shape)
    measured.update(_speedups(S, gpt, x, y, device, repeats))
    del gpt, x, y, loss
    g = torch.Generator().manual_seed(0)
    X = torch.randn(16384, 32, generator=g)
    with torch.no_grad():
        labels = (MLP(32, 64, 1, 10, seed=100)(X) * 3).argmax(1)     # a teacher's labels
    X, labels = X.to(device), labels.to(device)
    curves = {name: train_losses(S, X, labels, dtype, scaled=scaled, divide=S.amp_accum,
                                 device=device) for name, (dtype, scaled) in LOSS_RUNS.items()}
    measured.update(loss_figures(curves))
    return {"experiment": "mixed precision: bytes per parameter, activations, speed, training",
            "measured": measured, "predicted": predicted}


def _speedups(S, gpt, x, y, device: torch.device, repeats: int) -> dict:
    """fp32 time over 16-bit time: a square matmul of side S.amp_matmul, and a GPT Adam step
    under autocast (medians of `repeats`)."""
    a, b = (torch.randn(S.amp_matmul, S.amp_matmul, device=device) for _ in range(2))
    opt = torch.optim.Adam(gpt.parameters(), lr=1e-3)

    def gpt_step(dtype):
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = gpt.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out = {"matmul_fp32_seconds": median_seconds(lambda: a @ b, repeats=repeats, device=device),
           "gpt_step_fp32_seconds": median_seconds(lambda: gpt_step(None), repeats=repeats,
                                                   device=device)}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a16, b16 = a.to(dtype), b.to(dtype)
        mm = median_seconds(lambda: a16 @ b16, repeats=repeats, device=device)
        step = median_seconds(lambda: gpt_step(dtype), repeats=repeats, device=device)
        out[f"matmul_{name}_speedup"] = out["matmul_fp32_seconds"] / mm
        out[f"gpt_step_{name}_speedup"] = out["gpt_step_fp32_seconds"] / step
    return out


# ---------------------------------------------------------------- offload

def offload(S, device: torch.device, *, repeats: int = 3) -> dict:
    """ZeRO-Offload on one device (`CPUOffloadOptimizer`): device and host bytes after two AdamW
    steps against the course's placement (`estimate.offload_placement`), and the step's phases
    (`offload.step_phases`) against plain fused AdamW on the device."""
    def make() -> GPT:
        return GPT(S.vocab, S.seq_len, S.offload_width, S.offload_depth, S.gpt_heads,
                   device=device)

    x, y = (t.to(device) for t in make_tokens(S.offload_batch, S.seq_len, vocab=S.vocab))
    n = estimate.gpt_params(S.vocab, S.seq_len, S.offload_width, S.offload_depth)
    placed = estimate.offload_placement(n, zero_stage=2, offload_optimizer="cpu",
                                        convention="course", param_bytes=4)
    with track(device) as t:
        model = make()
        opt = CPUOffloadOptimizer(model.parameters(), lr=1e-3, weight_decay=0.1)
        for _ in range(2):
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad()
    plain = make()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    phases = {"plain AdamW": step_phases(lambda: plain.loss(x, y), plain_opt, steps=repeats,
                                         device=device),
              "offloaded AdamW": step_phases(lambda: model.loss(x, y), opt, steps=repeats,
                                             device=device)}
    return {"experiment": "ZeRO-Offload of AdamW: device and host bytes, step phases",
            "measured": offload_figures(phases, t),
            "predicted": {"device_bytes_after_training": placed.device,
                          "host_bytes_after_training": placed.host}}


def offload_figures(phases: dict[str, dict[str, float]], tracker) -> dict:
    """Chapter 08's measurements under the recorded names: `offload.step_phases` of "plain AdamW"
    and "offloaded AdamW", and the tracker of the offloaded training (bytes live at its end)."""
    step = {k: sum(p[s] for s in ("forward", "backward", "step")) for k, p in phases.items()}
    plain, offloaded = step["plain AdamW"], step["offloaded AdamW"]
    out = {"device_bytes_after_training": tracker.current,
           "host_bytes_after_training": tracker.host_current, "plain_step_seconds": plain,
           "offloaded_step_seconds": offloaded, "offloaded_over_plain_step": offloaded / plain}
    out.update({f"offloaded_{k}_seconds": v for k, v in phases["offloaded AdamW"].items()
                if k not in ("forward", "backward", "step")})
    return out
