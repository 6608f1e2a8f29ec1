"""Explain a CUDA memory snapshot: what was alive at the peak, by kind, and the cheapest levers.

`torch.cuda.memory._record_memory_history()` then `torch.cuda.memory._dump_snapshot("s.pickle")`
writes the allocator's segments and a trace of every allocation and free with the stack that made
it (the format `torch.cuda.memory._snapshot` documents; `companion.allocator` reads its figures).
`explain` replays the trace to the moment the most bytes were allocated and files each block
alive then under a kind, from the phase it was made in and how long it lived:

- the phase of each allocation and free is read from its stack: optimizer (a frame in
  `torch/optim/`), backward (the autograd engine's thread, see below), model (`nn.Module`'s
  `__init__`, `_apply`, `.to()`, `.cuda()`), forward (any other Python stack);
- temporaries: freed before the phase that made them ended (backward's intermediate gradients,
  the recomputation of checkpointed layers, the optimizer's foreach intermediates, forward's
  scratch, a model's old copy after `.to()`);
- parameters: made in the model phase and alive when it ended, or alive before the recording
  began (blocks in the segments with no trace event);
- activations: made in forward and alive when forward ended (saved for backward, or outputs the
  loop still holds);
- gradients: made in backward and alive when backward ended;
- optimizer state: made in the optimizer step and alive when the step ended;
- the allocator's cache: reserved minus allocated at the peak.

Backward runs on the autograd engine's own thread, which has no Python frames: "things allocated
during the backward pass have no stack frames because they are run on another C++ thread"
(pytorch/pytorch#82146). Recorded with torch's default `stacks="all"` (torch 2.13,
torch/cuda/memory.py `_record_memory_history_impl(..., stacks="all")`), a block made in backward
carries C++ frames only, down to `torch::autograd::Engine::evaluate_function` and
`Engine::thread_main` (so in the three public snapshots the tests read); with `stacks="python"`
it carries none (#82146 was written when only Python frames were recorded). So an allocation or
free with an engine frame, or with no Python frame in a trace whose other events have some, is
backward's, as is one whose outermost Python frame is in `torch/autograd/` or
`torch/utils/checkpoint.py` (the engine's thread running a Function's backward in Python, or a
checkpointed layer again).

    python -m companion explain snapshot.pickle          # or explain(snapshot) on the dict

The file is read as plain data: a snapshot holds only dicts, lists, strings and numbers, and an
unpickler that refuses every class and function reads it; a pickle that asks for one (code that
would run on loading) is refused, never run.

Simplified vs memory_viz (https://pytorch.org/memory_viz): kinds come from the rules above, which
a custom loop can defeat (work done on threads of its own, an optimizer outside `torch/optim/`
called from a frame that is not one); a trace recorded without stacks (`context=None` or
`stacks=None`) cannot be filed and is refused; a block made before the recording and freed during
it is not counted; memory_viz draws every block, this names the largest kinds.
"""
from __future__ import annotations

import io
import pathlib
import pickle

from companion.allocator import snapshot_report
from companion.memory import format_bytes

__all__ = ["explain", "explain_file", "format_explanation", "load_snapshot"]

KINDS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# Frame names of the autograd engine's thread, as the three public stacks="all" snapshots the
# tests read record them ("torch::autograd::Engine::evaluate_function(std::shared_ptr<...", ...).
_ENGINE = ("torch::autograd::Engine::", "torch::autograd::python::PythonEngine::")
_MODEL = ("__init__", "_apply", "to", "cuda", "reset_parameters", "load_state_dict")


def _python(frame: dict) -> bool:
    """A Python frame: a .py file, or "<string>"-like code (fx graphs, notebooks); C++ frames have
    "??", "" or a .cpp/.h/.o file."""
    path = str(frame.get("filename", ""))
    return path.endswith(".py") or path.startswith("<")


def _phase(frames: list[dict], *, stacks: bool) -> str | None:
    """The phase an allocation or free belongs to, from its stack; None where the stack says
    nothing (`stacks`: whether events of this action carry Python frames elsewhere in the trace)."""
    py = [(str(f.get("filename", "")).replace("\\", "/"), str(f.get("name", "")))
          for f in frames if _python(f)]
    if any("/torch/optim/" in path for path, _ in py):
        return "optimizer"         # before the engine: an optimizer step run from a grad hook
    if any(str(f.get("name", "")).startswith(_ENGINE) for f in frames):
        return "backward"          # stacks="all": the engine thread's C++ frames
    if not py:
        return "backward" if stacks else None   # stacks="python": the engine thread has no frame
    outer = py[-1][0]              # the engine thread running Python: Function.backward, recompute
    if "/torch/autograd/" in outer or outer.endswith("/torch/utils/checkpoint.py"):
        return "backward"
    if any("/torch/autograd/" in path and name in ("backward", "_engine_run_backward", "grad")
           or path.endswith("/torch/_tensor.py") and name == "backward" for path, name in py):
        return "backward"          # the main thread's share: the seed gradient (torch.ones_like)
    if any(name in _MODEL and "/torch/nn/modules/" in path for path, name in py):
        return "model"
    return "forward"


def _replay(trace: list[dict]) -> dict:
    """One pass over the trace: {"blocks": [size, phase made in, event made at, event freed at
    or None, freed within the run of phases that made it, that run's number] per allocation,
    "peak_at": the event of the peak, "phase": the phase then, "allocated": traced bytes then,
    "reserved_delta": segment bytes gained from the start to the peak, "reserved_end": from the
    start to the end}. A run is a stretch of events of one phase (forward, backward, step, ...)."""
    if not any(e["action"] == "alloc" for e in trace):
        raise ValueError("the trace records no allocation: record with torch.cuda.memory."
                         "_record_memory_history() before the step")
    stacks = {kind: any(_python(f) for e in trace if e["action"] == kind
                        for f in e.get("frames", ())) for kind in ("alloc", "free_requested")}
    if not stacks["alloc"]:
        raise ValueError("the trace carries no Python stack frames (recorded with context=None "
                         "or stacks=None), so its blocks cannot be told apart: record with "
                         "torch.cuda.memory._record_memory_history() (its defaults keep stacks)")
    blocks: list[list] = []
    live: dict[int, list] = {}                 # address -> its block
    phase, run, allocated, reserved = None, 0, 0, 0
    out = {"blocks": blocks, "peak_at": 0, "phase": "forward", "allocated": -1, "reserved_delta": 0}
    for number, entry in enumerate(trace):
        action = entry["action"]
        if action in stacks:                   # alloc and free_requested: the thread that asked
            seen = _phase(entry.get("frames") or [], stacks=stacks[action])
            if seen is not None and seen != phase:
                phase, run = seen, run + 1
        if action == "alloc":
            live[entry["addr"]] = block = [entry["size"], phase, number, None, False, run]
            blocks.append(block)
            allocated += entry["size"]
            if allocated > out["allocated"]:
                out.update(peak_at=number, phase=phase, allocated=allocated,
                           reserved_delta=reserved)
        elif action in ("free_requested", "free_completed") and entry["addr"] in live:
            block = live[entry["addr"]]
            block[4] = block[4] or block[5] == run   # freed in the run that made it
            if action == "free_completed":
                block[3] = number
                allocated -= block[0]
                del live[entry["addr"]]
        elif action in ("segment_alloc", "segment_free"):
            reserved += entry["size"] if action == "segment_alloc" else -entry["size"]
    out["reserved_end"] = reserved
    return out


def _kind(phase: str, short_lived: bool) -> str:
    if short_lived:
        return "temporaries"
    return {"model": "parameters", "backward": "gradients",
            "optimizer": "optimizer_state"}.get(phase, "activations")


def explain(snapshot: dict, *, device: int = 0) -> dict:
    """{"peak": bytes allocated at the peak, "phase": where the peak fell, "kinds": {kind:
    bytes}, "cache": reserved minus allocated then, "reserved", "fragmentation" (the snapshot's
    end, `allocator.snapshot_report`), "levers": the cheapest levers, largest kind first}."""
    trace = _check(snapshot, device)
    replay = _replay(trace)
    traced = {e["addr"] for e in trace if e["action"] == "alloc"}
    before = sum(b["size"] for s in snapshot["segments"] if s.get("device", device) == device
                 for b in s["blocks"] if b["state"] == "active_allocated"
                 and b["address"] not in traced)
    kinds = dict.fromkeys(KINDS, 0)
    kinds["parameters"] = before
    peak_at = replay["peak_at"]
    for size, made, made_at, freed_at, short_lived, _ in replay["blocks"]:
        if made_at <= peak_at and (freed_at is None or freed_at > peak_at):
            kinds[_kind(made, short_lived)] += size
    report = snapshot_report(snapshot, device=device)
    # segments reserved before the recording, plus those the trace added up to the peak
    at_peak = report["reserved"] - replay["reserved_end"] + replay["reserved_delta"]
    total = replay["allocated"] + before
    return {"peak": total, "phase": replay["phase"], "kinds": kinds,
            "cache": max(0, at_peak - total), "reserved": report["reserved"],
            "fragmentation": report["fragmentation"],
            "levers": _levers(kinds, replay["phase"], report["fragmentation"])}


_LEVERS = {
    "activations": "activations: checkpointing (chapter 04), smaller micro-batches with "
                   "accumulation (03), bf16 autocast (05), FlashAttention (10)",
    "optimizer_state": "optimizer state: 8-bit Adam (chapter 11), ZeRO-1/2 over GPUs (07), "
                       "optimizer offload to the host (08)",
    "gradients": "gradients: ZeRO-2 (chapter 07), LoRA trains a few parameters (09), the "
                 "optimizer step fused into backward without accumulation (each gradient freed "
                 "once applied: PyTorch's optimizer_step_in_backward_tutorial)",
    "parameters": "parameters: bf16 weights (chapter 05), ZeRO-3/FSDP (07), a frozen base in NF4 "
                  "(QLoRA, 11)",
    "temporaries": "backward's temporaries: chunked cross-entropy for a large vocabulary "
                   "(companion.chunked_loss), fused kernels",
}
# Where the peak falls changes what a kind's bytes are and which lever lowers them.
_AT_PHASE = {
    ("activations", "optimizer"):
        "tensors from forward still alive at the optimizer step (outputs and the loss the loop "
        "still holds, or a graph kept by retain_graph=True): drop them before step(); "
        "checkpointing would not lower this peak",
    ("temporaries", "optimizer"):
        "the optimizer's temporaries: foreach=False steps one parameter at a time (the foreach "
        "path uses ~ sizeof(params) more peak memory, torch/optim/optimizer.py _foreach_doc)",
    ("temporaries", "model"):
        "the model's temporaries: copies made while it is built, moved or loaded (build it on "
        "the GPU in its final dtype)",
    ("temporaries", "forward"):
        "forward's temporaries: chunked cross-entropy (companion.chunked_loss), fused kernels, "
        "FlashAttention (chapter 10)",
}


def _levers(kinds: dict[str, int], phase: str, fragmentation: float) -> list[str]:
    out = [_AT_PHASE.get((k, phase), _LEVERS[k])
           for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v > 0][:3]
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


class _DataOnly(pickle.Unpickler):
    """Reads dicts, lists, strings and numbers; refuses every class, function and persistent id,
    so nothing in the file runs."""

    def find_class(self, module: str, name: str):
        raise ValueError(f"not a CUDA memory snapshot (the file holds code: it asks for "
                         f"{module}.{name}, which a snapshot never does; nothing was run)")

    def persistent_load(self, pid):
        raise ValueError("not a CUDA memory snapshot (it refers to tensors stored beside it, as "
                         "a torch.save checkpoint does)")


def load_snapshot(data: bytes) -> dict:
    """A snapshot's dict from the bytes `torch.cuda.memory._dump_snapshot` wrote, read as plain
    data; ValueError("not a CUDA memory snapshot (...)") for anything else."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"not a CUDA memory snapshot ({why})")
    if not data:
        raise refuse("the file is empty")
    if data[:4] == b"PK\x03\x04":
        raise refuse("a zip archive, as torch.save writes a checkpoint")
    if data.lstrip()[:1] in (b"{", b"["):
        raise refuse("text starting with '{' or '[', JSON perhaps; a snapshot is a pickle")
    stream = io.BytesIO(data)
    try:
        snapshot = _DataOnly(stream).load()
    except ValueError as e:
        if str(e).startswith("not a CUDA memory snapshot"):
            raise
        raise refuse(f"not a readable pickle: {e}") from None
    except EOFError:
        raise refuse("the pickle is truncated") from None
    except Exception as e:       # the unpickler's own errors on bytes that are not a pickle
        raise refuse(f"not a readable pickle: {e}") from None
    if stream.tell() < len(data):
        raise refuse("more than one pickle in the file, as torch.save's legacy format writes")
    if not isinstance(snapshot, dict):
        raise refuse(f"a pickled {type(snapshot).__name__}, not the dict torch.cuda.memory."
                     "_snapshot() returns")
    return snapshot


def _frames_ok(event: dict) -> bool:
    frames = event.get("frames", [])
    return isinstance(frames, list) and all(isinstance(f, dict) for f in frames)


def _check(snapshot, device: int) -> list[dict]:
    """The trace of `device`, after checking the fields `explain` reads."""
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise ValueError("not a CUDA memory snapshot (expected the dict torch.cuda.memory."
                         "_snapshot() returns, with segments and device_traces)")
    for s in snapshot["segments"]:
        if not (isinstance(s, dict) and isinstance(s.get("total_size"), int)
                and isinstance(s.get("allocated_size"), int) and isinstance(s.get("blocks"), list)
                and all(isinstance(b, dict) and {"address", "size", "state"} <= b.keys()
                        and _frames_ok(b) for b in s["blocks"])):
            raise ValueError("not a CUDA memory snapshot (a segment without total_size, "
                             "allocated_size or blocks, or a block without address, size or "
                             "state)")
    traces = snapshot.get("device_traces") or [[]]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise ValueError("not a CUDA memory snapshot (device_traces is not a list of lists)")
    trace = traces[device] if 0 <= device < len(traces) else []
    if not trace:
        raise ValueError(f"the snapshot has no trace for device {device} (it has traces for "
                         f"{len(traces)} device(s)): record one with torch.cuda.memory."
                         "_record_memory_history() before the step, then _dump_snapshot(path)")
    for number, e in enumerate(trace):
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):
            raise ValueError(f"not a CUDA memory snapshot (trace entry {number} has no action)")
        if e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc",
                           "segment_free") and not (isinstance(e.get("addr"), int)
                                                    and isinstance(e.get("size"), int)):
            raise ValueError(f"not a CUDA memory snapshot (trace entry {number}, "
                             f"{e['action']!r}, has no whole-number 'addr' and 'size')")
        if not _frames_ok(e):
            raise ValueError(f"not a CUDA memory snapshot (trace entry {number}'s frames are "
                             "not a list of dicts)")
    return trace


def explain_file(path: str | pathlib.Path, *, device: int = 0) -> dict:
    """`explain` of a pickle written by `torch.cuda.memory._dump_snapshot(path)`, read as plain
    data (`load_snapshot`): a file that holds code is refused, not run. A file over 1 MiB that
    does not open as a pickle of protocol 2 or later (`_dump_snapshot` writes pickle's default,
    4 or 5) is refused before the rest of it is read."""
    path = pathlib.Path(path)
    with path.open("rb") as f:
        head = f.read(_PEEK)
        if len(head) == _PEEK and head[:1] != b"\x80":
            raise ValueError(f"not a CUDA memory snapshot (a file of "
                             f"{path.stat().st_size:,} bytes that does not open as a pickle: "
                             f"first bytes {head[:8]!r})")
        data = head + f.read()
    return explain(load_snapshot(data), device=device)


_PEEK = 2**20                 # bytes read before deciding a large file is worth reading whole
