"""The CUDA caching allocator's own tools, read the way the course reads its CPU ledger.

PyTorch does not call cudaMalloc for every tensor. Its caching allocator takes *segments* from the
driver and carves *blocks* for tensors out of them; a freed block stays in the cache for the next
tensor. Its counters: `torch.cuda.memory_allocated` (bytes in live blocks) and
`max_memory_allocated` (their peak since `reset_peak_memory_stats`), `memory_reserved` (bytes of
all segments, live or cached). Its history: after `torch.cuda.memory._record_memory_history()`,
every allocation and free is recorded with its stack; `torch.cuda.memory._snapshot()` returns
{"segments": [...], "device_traces": [[...]]} (documented in `torch.cuda.memory._snapshot`), and
`_dump_snapshot(path)` pickles it for the viewer at https://pytorch.org/memory_viz.

`snapshot_report` reads a snapshot into the figures one looks for in that viewer (reserved,
allocated, the cache's free bytes and its largest free block, the largest tensors and the line
that made them); `snapshot_timeline` replays its trace into bytes live after each event, the same
curve `MemoryTracker.timeline()` draws on the CPU. `growing_batches` runs the case the CUDA
documentation gives for `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` (a batch that grows
step by step) in a fresh process, with and without the setting, and returns peak reserved against
peak allocated. `validate.replay_snapshot` replays a snapshot's trace through the modelled
allocator and sets each cudaMalloc beside PyTorch's.

Example (on a GPU):
    >>> torch.cuda.memory._record_memory_history(max_entries=100_000)
    >>> train_step()
    >>> report = snapshot_report(torch.cuda.memory._snapshot())
    >>> torch.cuda.memory._record_memory_history(enabled=None)

Simplified vs PyTorch: memory_viz also draws each block over time with its stack and shows the
segments' layout; here, figures only.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import torch

__all__ = ["snapshot_report", "snapshot_timeline", "growing_batches", "growing_batches_trace"]

def _where(frames: list[dict]) -> str:
    """The innermost Python frame of a block's stack outside PyTorch: "file.py:12 in fn", without
    folders (C++ frames, recorded with stacks="all", are skipped)."""
    for frame in frames:
        path = pathlib.Path(frame.get("filename", ""))
        if path.suffix == ".py" and "torch" not in path.parts:
            return f"{path.name}:{frame.get('line')} in {frame.get('name')}"
    return "(no Python frame recorded)"


def snapshot_report(snapshot: dict, *, top: int = 3, device: int | None = None) -> dict:
    """The allocator's state in a snapshot, in plain figures (of every GPU in it, or of `device`).

    Returns {"segments": how many cudaMalloc'd segments, "reserved": their bytes, "allocated":
    bytes in live blocks, "cached_free": bytes of free blocks, "largest_free_block",
    "fragmentation": 1 − largest free block / free bytes (0: the cache's free bytes are one
    piece; near 1: many small pieces, none of which fits a large request), "largest": the `top`
    largest live blocks as (bytes, where they were allocated)}."""
    segments = [seg for seg in snapshot["segments"]
                if device is None or seg.get("device", device) == device]
    blocks = [b for s in segments for b in s["blocks"]]
    free = [b["size"] for b in blocks if b["state"] == "inactive"]
    live = sorted((b for b in blocks if b["state"] == "active_allocated"),
                  key=lambda b: b["size"], reverse=True)
    largest_free = max(free, default=0)
    return {"segments": len(segments),
            "reserved": sum(s["total_size"] for s in segments),
            "allocated": sum(s["allocated_size"] for s in segments),
            "cached_free": sum(free),
            "largest_free_block": largest_free,
            "fragmentation": 1 - largest_free / sum(free) if free else 0.0,
            "largest": [(b["size"], _where(b.get("frames", []))) for b in live[:top]]}


def snapshot_timeline(snapshot: dict, *, device: int = 0) -> dict[str, list[int]]:
    """Replay a recorded trace: bytes allocated and reserved after each event, counted from the
    start of the recording (as `track` counts from the start of its block).

    Returns {"action": each event's action, "allocated": [...], "reserved": [...]}. "alloc" adds
    a block's bytes, "free_completed" removes them (the block is free for reuse), "segment_alloc"
    and "segment_free" change the reserve."""
    out: dict[str, list] = {"action": [], "allocated": [], "reserved": []}
    allocated = reserved = 0
    change = {"alloc": (1, 0), "free_completed": (-1, 0), "segment_alloc": (0, 1),
              "segment_free": (0, -1)}
    traces = snapshot.get("device_traces") or [[]]
    for entry in traces[device]:
        sign_a, sign_r = change.get(entry["action"], (0, 0))
        allocated += sign_a * entry.get("size", 0)
        reserved += sign_r * entry.get("size", 0)
        out["action"].append(entry["action"])
        out["allocated"].append(allocated)
        out["reserved"].append(reserved)
    return out


def _growing_steps(width: int, depth: int, start: int, steps: int, device=None) -> None:
    """The case: an MLP built, then one forward and backward per batch size start, start + 1, ..."""
    from companion.models import MLP
    model = MLP(width, width, depth, 10, device=device)
    for batch in range(start, start + steps):
        x = torch.randn(batch, width, device=device)                     # (batch, width)
        model.loss(x, torch.zeros(batch, dtype=torch.long, device=device)).backward()
        model.zero_grad(set_to_none=True)
        del x


def _growing_batches_here(width: int, depth: int, start: int, steps: int) -> dict:
    """In this process (on CUDA): `_growing_steps`; peak allocated and reserved over them."""
    torch.cuda.reset_peak_memory_stats()
    _growing_steps(width, depth, start, steps, device="cuda")
    torch.cuda.synchronize()
    return {"max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "reserved_at_end": torch.cuda.memory_reserved()}


def growing_batches(*, expandable: bool, width: int = 4096, depth: int = 8, start: int = 1024,
                    steps: int = 16, timeout: float = 300.0) -> dict:
    """Run `_growing_batches_here` in a fresh Python process, with
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or without it (the allocator reads the
    setting once, when CUDA starts), and return its figures. Needs a CUDA device."""
    if not torch.cuda.is_available():
        raise RuntimeError("growing_batches measures the CUDA caching allocator: it needs a GPU")
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    code = ("import json\nfrom companion.allocator.snapshot import _growing_batches_here\n"
            f"print(json.dumps(_growing_batches_here({width}, {depth}, {start}, {steps})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def growing_batches_trace(*, width: int = 4096, depth: int = 8, start: int = 1024,
                          steps: int = 16):
    """The allocations and frees of `_growing_steps` (what `growing_batches` runs on a GPU),
    recorded by `track` on fake tensors: shapes and dtypes, no memory, so it runs on any machine
    in a second or two. Replay it through the modelled allocator (`rules.replay(trace,
    config=...)`) to see, without a GPU, what `growing_batches` measures on one."""
    from torch._subclasses import FakeTensorMode

    from companion.memory import track
    from companion.plan.simulation import _fake_addresses
    for name, value in (("width", width), ("depth", depth), ("start", start), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} is a positive whole number, got {value!r}")
    with FakeTensorMode(), _fake_addresses():
        with track("cpu") as tracker:
            _growing_steps(width, depth, start, steps)
    return tracker
