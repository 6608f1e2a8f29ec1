"""Mixed precision: our GradScaler against torch.amp.GradScaler; activation bytes under autocast.

1. Speed. The course GPT (sizes from `companion.device.sizes`) with Adam. Before each timed call,
   the same scaled fp32 gradients are copied into .grad (one in every `--inf-every` with an inf,
   so that some steps are skipped); then `unscale_` + `step` + `update` is timed, for
   `companion.amp.GradScaler` and `torch.amp.GradScaler` interleaved, median of `--steps` each.
   Also `unscale_` alone (the part that differs most: PyTorch's is one fused kernel per device
   and dtype). Time is the CPU time of the one thread that runs it, so the ratio holds on a
   shared machine. Goal: ours within 1.5x of torch's.
2. Memory. Bytes that the course MLP and GPT save for backward (what stays live after the
   forward), fp32 against bf16 autocast, measured by `companion.memory.track`, beside
   `companion.estimate`.

    python benchmarks/bench_amp.py [--steps 50] [--inf-every 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from companion import amp, estimate
from companion.device import describe, pick_device, sizes
from companion.memory import format_bytes, track
from companion.models import GPT, MLP, make_classification, make_tokens


def _scaled_grads(model, x, y, device, scale=2.0**16):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model.loss(x, y)
    (loss * scale).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _clock(device):
    """Thread CPU time on the CPU (robust to other jobs); wall time after a sync on CUDA."""
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(), time.perf_counter())[1]   # host-device sync
    return time.thread_time


def bench_speed(steps: int, inf_every: int, device: torch.device) -> dict[str, tuple[float, float]]:
    s = sizes(device)
    model = GPT(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth, s.gpt_heads, seed=0, device=device)
    x, y = (t.to(device) for t in make_tokens(s.batch, s.seq_len, vocab=s.vocab))
    grads = _scaled_grads(model, x, y, device)
    clock = _clock(device)
    setups = {}
    for name, make in [("ours", amp.GradScaler), ("torch", torch.amp.GradScaler)]:
        replica = GPT(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth, s.gpt_heads, seed=0,
                      device=device)
        setups[name] = (replica, torch.optim.Adam(replica.parameters(), lr=1e-4), make(device.type))
    times = {name: {"step": [], "unscale": []} for name in setups}
    for i in range(steps):
        poison = float("inf") if i % inf_every == inf_every - 1 else 1.0
        for name, (replica, opt, scaler) in setups.items():
            for part in ("step", "unscale"):
                scaler.scale(torch.ones((), device=device))          # makes the scale on first use
                for p, g in zip(replica.parameters(), grads):
                    p.grad = g.clone()
                next(replica.parameters()).grad.view(-1)[0] *= poison
                start = clock()
                scaler.unscale_(opt)
                if part == "step":
                    scaler.step(opt)
                    scaler.update()
                times[name][part].append(clock() - start)
                if part == "unscale":
                    scaler.update()                                  # outside the timing
    return {name: (statistics.median(t["step"]), statistics.median(t["unscale"]))
            for name, t in times.items()}


def _saved(loss_fn) -> int:
    with track("cpu") as t:
        loss = loss_fn()
    return t.current - loss.untyped_storage().nbytes()


def bench_memory() -> list[tuple]:
    s = sizes("cpu")
    rows = []
    mlp = MLP(s.width, s.width, s.depth, 10, seed=0)
    X, y = make_classification(s.ckpt_batch, s.width, 10)
    gpt = GPT(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth, s.gpt_heads, seed=0)
    tokens, targets = make_tokens(s.amp_gpt_batch, s.seq_len, vocab=s.vocab)
    cases = [
        (f"MLP {s.depth} x {s.width}, batch {s.ckpt_batch}", lambda: mlp.loss(X, y),
         estimate.mlp_activations(s.ckpt_batch, s.width, s.depth, 10),
         estimate.mlp_activations(s.ckpt_batch, s.width, s.depth, 10, precision="autocast",
                                  d_in=s.width)),
        (f"GPT {s.gpt_depth} x {s.gpt_width}, batch {s.amp_gpt_batch} x {s.seq_len}",
         lambda: gpt.loss(tokens, targets),
         estimate.gpt_activations(s.amp_gpt_batch, s.seq_len, s.gpt_width, s.gpt_depth,
                                  s.gpt_heads, s.vocab),
         estimate.gpt_activations(s.amp_gpt_batch, s.seq_len, s.gpt_width, s.gpt_depth,
                                  s.gpt_heads, s.vocab, precision="autocast")),
    ]
    for name, loss_fn, pred32, pred16 in cases:
        fp32 = _saved(loss_fn)

        def autocast_loss(fn=loss_fn):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn()
        low = _saved(autocast_loss)
        rows.append((name, fp32, pred32, low, pred16))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--inf-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = pick_device()
    info = describe(device)
    print(f"{info['name']} ({device}), torch {info['torch']}, 1 thread, median of {args.steps}")
    speed = bench_speed(args.steps, args.inf_every, device)
    print("| part | ours | torch | ratio |")
    print("|---|---|---|---|")
    for i, part in enumerate(["unscale_ + step (Adam) + update", "unscale_ alone"]):
        ours, theirs = speed["ours"][i], speed["torch"][i]
        print(f"| {part} | {ours * 1e3:.2f} ms | {theirs * 1e3:.2f} ms | {ours / theirs:.2f}x |")
    print()
    print("| model | fp32 measured | fp32 predicted | bf16 autocast measured | predicted | ratio |")
    print("|---|---|---|---|---|---|")
    for name, fp32, pred32, low, pred16 in bench_memory():
        print(f"| {name} | {format_bytes(fp32)} | {format_bytes(pred32)} | {format_bytes(low)} | "
              f"{format_bytes(pred16)} | {low / fp32:.3f} |")


if __name__ == "__main__":
    main()
