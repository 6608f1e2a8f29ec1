"""Overhead of companion.memory.track on a training step of the course's models.

Runs the same step with and without the tracker, interleaved so that all see the same machine
load, and prints the ratio of median step times (tracked over untracked). For scale it also times
the step under an empty `TorchDispatchMode` that only calls each operator: the floor that any
tracker built on a Python dispatch mode pays. Times are the CPU time of the one thread that runs
the step (`torch.set_num_threads(1)`, `time.thread_time`), so that other processes on a shared
machine do not move the ratio. One run, no assertions: the goal is under 1.5x.

    python benchmarks/bench_memory.py [--steps 30]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from companion.device import describe, sizes
from companion.memory import format_bytes, track
from companion.models import GPT, MLP, make_classification, make_tokens


class _EmptyMode(TorchDispatchMode):
    """Calls each operator and nothing else."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _mlp(s):
    model = MLP(s.width, s.width, s.depth, 10, seed=0)
    data = make_classification(s.batch, s.width, 10, seed=0)
    return model, data


def _gpt(s):
    model = GPT(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth, s.gpt_heads, seed=0)
    data = make_tokens(s.batch, s.seq_len, vocab=s.vocab, seed=0)
    return model, data


def bench(label: str, model, data, steps: int) -> float:
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        model.loss(*data).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    variants = {"untracked": contextlib.nullcontext, "empty mode": _EmptyMode,
                "tracked": lambda: track("cpu")}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(3):                                         # warm up every path
        for ctx in variants.values():
            with ctx():
                step()
    for _ in range(steps):
        for name, ctx in variants.items():
            start = time.thread_time()
            with ctx() as t:
                step()
            times[name].append(time.thread_time() - start)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    ratio, floor = ms["tracked"] / ms["untracked"], ms["empty mode"] / ms["untracked"]
    print(f"{label:>4}: untracked {ms['untracked']:7.2f} ms, tracked {ms['tracked']:7.2f} ms, "
          f"ratio {ratio:.2f}x (empty dispatch mode alone: {floor:.2f}x; "
          f"peak above entry {format_bytes(t.peak)})")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    s = sizes("cpu")
    info = describe("cpu")
    print(f"torch {info['torch']} on {info['name']}, {info['threads']} thread; sizes: {s}")
    bench("MLP", *_mlp(s), args.steps)
    bench("GPT", *_gpt(s), args.steps)


if __name__ == "__main__":
    main()
