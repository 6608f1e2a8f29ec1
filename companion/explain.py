"""Explain a CUDA memory snapshot: what was alive at the peak, by kind, and the cheapest levers.

`torch.cuda.memory._record_memory_history()` then `torch.cuda.memory._dump_snapshot("s.pickle")`
writes the allocator's segments and a trace of every allocation and free with its Python stack
(the format `torch.cuda.memory._snapshot` documents; `companion.allocator` reads its figures).
`explain` replays the trace to the moment the most bytes were allocated and files each block
alive then under a kind, from the stack that allocated it and the phase it was made in:

- optimizer state: made inside `torch/optim/` (`step`, `_init_group`);
- gradients: made in backward (under `torch/autograd/`'s `backward`) and still alive when
  backward ended (what backward frees before it ends were its temporaries);
- parameters: made by `nn.Module.__init__`, `.to()`, `.cuda()` or `_apply` (moving a model), or
  alive before the recording began (blocks in the segments with no trace event);
- activations: made in forward (any other stack) and alive at the peak;
- temporaries: made in backward and freed before it ended; the allocator's cache: reserved
  minus allocated at the peak.

    python -m companion explain snapshot.pickle          # or explain(snapshot) on the dict

Simplified vs memory_viz (https://pytorch.org/memory_viz): a kind is read from the stack by the
rules above, which a custom training loop can defeat (record with `stacks="python"`, the
default, so Python frames are there); a block made before the recording and freed during it is
not seen at all (the trace has only its free); memory_viz draws every block, this names the
largest kinds.
"""
from __future__ import annotations

import pathlib
import pickle

from companion.allocator import snapshot_report
from companion.memory import format_bytes

__all__ = ["explain", "explain_file", "format_explanation"]

KINDS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


def _files(frames: list[dict]) -> list[tuple[str, str]]:
    return [(str(f.get("filename", "")).replace("\\", "/"), str(f.get("name", ""))) for f in frames]


def _phase(frames: list[dict]) -> str:
    files = _files(frames)
    if any("/torch/optim/" in path for path, _ in files):
        return "optimizer"
    if any("/torch/autograd/" in path and name in ("backward", "_engine_run_backward")
           or path.endswith("torch/_tensor.py") and name == "backward" for path, name in files):
        return "backward"
    if any(name in ("__init__", "_apply", "to", "cuda", "reset_parameters", "load_state_dict")
           and "/torch/nn/modules/" in path for path, name in files):
        return "model"
    return "forward"


def explain(snapshot: dict, *, device: int = 0) -> dict:
    """{"peak": bytes allocated at the peak, "phase": where the peak fell, "kinds": {kind:
    bytes}, "cache": reserved minus allocated then, "reserved", "fragmentation" (the snapshot's
    end, `allocator.snapshot_report`), "levers": the cheapest levers, largest kind first}."""
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise ValueError("not a CUDA memory snapshot: expected the dict torch.cuda.memory."
                         "_snapshot() returns (segments, device_traces)")
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[device] if device < len(traces) else []
    if not trace:
        raise ValueError("the snapshot has no trace: record one with torch.cuda.memory."
                         "_record_memory_history() before the step, then _dump_snapshot(path)")
    traced = {e["addr"] for e in trace if e.get("action") == "alloc"}
    before = {b["address"]: b["size"] for s in snapshot["segments"]
              if s.get("device", device) == device for b in s["blocks"]
              if b["state"] == "active_allocated" and b["address"] not in traced}
    live: dict[int, tuple[int, str, int]] = {}   # address -> (bytes, phase made in, alloc no.)
    allocated = reserved = peak = peak_reserved = 0
    peak_live: dict[int, tuple[int, str, int]] = {}
    peak_phase = phase_now = "forward"
    temporaries: set[int] = set()     # blocks made in backward and freed before it ended
    for number, entry in enumerate(trace):
        action, addr, size = entry.get("action"), entry.get("addr"), entry.get("size", 0)
        if action == "alloc":
            phase_now = _phase(entry.get("frames", []))
            live[addr] = (size, phase_now, number)
            allocated += size
            if allocated > peak:
                peak, peak_live, peak_phase, peak_reserved = allocated, dict(live), phase_now, reserved
        elif action == "free_completed" and addr in live:
            freed, made, made_no = live.pop(addr)
            allocated -= freed
            if made == "backward" and phase_now == "backward":
                temporaries.add(made_no)
        elif action == "segment_alloc":
            reserved += size
        elif action == "segment_free":
            reserved -= size
    kinds = dict.fromkeys(KINDS, 0)
    kinds["parameters"] = sum(before.values())
    for size, made, made_no in peak_live.values():
        if made == "backward":
            kind = "temporaries" if made_no in temporaries else "gradients"
        else:
            kind = {"optimizer": "optimizer_state", "model": "parameters"}.get(made, "activations")
        kinds[kind] += size
    report = snapshot_report(snapshot, device=device)
    at_peak = report["reserved"] - reserved + peak_reserved  # segments from before the recording
    total = peak + sum(before.values())                      # with the blocks made before it
    return {"peak": total, "phase": peak_phase, "kinds": kinds,
            "cache": max(0, at_peak - total), "reserved": report["reserved"],
            "fragmentation": report["fragmentation"],
            "levers": _levers(kinds, report["fragmentation"])}


_LEVERS = {
    "activations": "activations: checkpointing (chapter 04), smaller micro-batches with "
                   "accumulation (03), bf16 autocast (05), FlashAttention (10)",
    "optimizer_state": "optimizer state: 8-bit Adam (chapter 11), ZeRO-1/2 over GPUs (07), "
                       "optimizer offload to the host (08)",
    "gradients": "gradients: ZeRO-2 (chapter 07), LoRA trains a few parameters (09)",
    "parameters": "parameters: bf16 weights (chapter 05), ZeRO-3/FSDP (07), a frozen base in NF4 "
                  "(QLoRA, 11)",
    "temporaries": "backward's temporaries: chunked cross-entropy for a large vocabulary "
                   "(companion.chunked_loss), fused kernels",
}


def _levers(kinds: dict[str, int], fragmentation: float) -> list[str]:
    out = [_LEVERS[k] for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v > 0][:3]
    if fragmentation > 0.3:
        out.append(f"the cache is fragmented ({fragmentation:.0%} of its free bytes outside the "
                   "largest free block): PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    return out


def format_explanation(found: dict) -> str:
    lines = [f"peak {format_bytes(found['peak'])} allocated, in {found['phase']}; the allocator "
             f"held {format_bytes(found['cache'])} more in its cache then"]
    for kind, n in found["kinds"].items():
        share = n / found["peak"] if found["peak"] else 0.0
        lines.append(f"  {kind.replace('_', ' '):<18}{format_bytes(n):>12}  {share:>5.0%}")
    lines.append(f"fragmentation at the end: {found['fragmentation']:.0%}")
    lines += ["cheapest levers, largest kind first:"] + [f"  - {x}" for x in found["levers"]]
    return "\n".join(lines)


def explain_file(path: str | pathlib.Path, *, device: int = 0) -> dict:
    """`explain` of a pickle written by `torch.cuda.memory._dump_snapshot(path)`. Unpickling runs
    code: explain only snapshots you made or trust."""
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    return explain(snapshot, device=device)
