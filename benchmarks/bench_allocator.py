"""Our model of the CUDA caching allocator against a real one: a memory snapshot's trace replayed
through `companion.allocator.CachingAllocator`, request by request.

Record a snapshot on your GPU, then run this on it (no GPU needed to run it):

    torch.cuda.memory._record_memory_history(max_entries=100_000)
    train_step()
    torch.cuda.memory._dump_snapshot("snapshot.pickle")

    python benchmarks/bench_allocator.py snapshot.pickle [--device 0] [--show 10]

Prints how many of PyTorch's cudaMallocs the model makes for the same request, how many requests
it places at PyTorch's address, reserved bytes (peak, and the first event where they differ), the
segments at the end, and the first disagreements (`companion.allocator.validate`). Exit status 1
when the model and the recording disagree.
"""
from __future__ import annotations

import argparse
import pickle
import sys

from companion.allocator import format_replay, replay_snapshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", help="a pickle written by torch.cuda.memory._dump_snapshot")
    parser.add_argument("--device", type=int, default=0, help="which GPU's trace (default 0)")
    parser.add_argument("--show", type=int, default=10, help="disagreements to list")
    args = parser.parse_args(argv)
    with open(args.path, "rb") as f:
        snapshot = pickle.load(f)          # a pickle runs code when loaded: only your own files
    traces = snapshot.get("device_traces") or []
    if args.device >= len(traces) or not traces[args.device]:
        print(f"{args.path} has no trace for device {args.device}: record it with "
              "torch.cuda.memory._record_memory_history() before the step", file=sys.stderr)
        return 2
    found = replay_snapshot(snapshot, device=args.device)
    print(format_replay(found, show=args.show))
    return 0 if found.agrees else 1


if __name__ == "__main__":
    sys.exit(main())
