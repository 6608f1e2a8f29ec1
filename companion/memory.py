"""Measure memory on any device: live and peak bytes, a breakdown by kind, a timeline, a budget.

On CUDA the caching allocator already counts every byte (`torch.cuda.max_memory_allocated`). A CPU
has no such counter, so here the tracker keeps its own ledger: a `TorchDispatchMode` sees every
tensor an operator returns, counts each new *storage* once (views and `detach()` share a storage,
so they cost nothing), and a weak reference on the storage subtracts its bytes the moment it is
freed. The same ledger labels storages by kind (parameters, gradients, optimizer state, activations
saved for backward, other temporaries) and records when each byte arrived (forward, backward,
optimizer step), on either device.

Device and host. Offloading keeps tensors in host (CPU) memory while the model trains on the
device. On CUDA the ledger tells them apart by the storage's device: CUDA storages are device
bytes, CPU storages host bytes. Without a GPU both are the same RAM, so the split is made explicit
(`companion.placement`): storages allocated inside `with on_host():` are host bytes, the rest
device bytes. Host bytes are reported apart (`host_peak`, `breakdown(where="host")`) and never
count against `memory_budget`, which caps the device only. Storages made inside
`with on_disk():` (files mapped into memory) count as neither.

Example:
    >>> with track() as t:
    ...     loss = model(x).square().mean(); loss.backward(); opt.step()
    >>> t.peak, t.breakdown()
    >>> with memory_budget("64 MiB"):      # on CPU: fails like a GPU would
    ...     model(torch.randn(10**6, 512))  # torch.OutOfMemoryError

Simplified vs PyTorch: the CPU ledger counts storages that operators return, not scratch buffers an
operator allocates and frees inside its own kernel, and it cannot see tensors freed inside the block
that were created before it (their bytes were never added, so they are never subtracted).
"""
from __future__ import annotations

import array
import contextlib
import re
import weakref
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from companion.memory_plot import plot_timeline
from companion.placement import DEVICE as _DEVICE, HOST as _HOST, on_disk, on_host, storage_place

__all__ = ["KINDS", "PHASES", "MemoryTracker", "track", "measure", "memory_budget", "parse_bytes",
           "format_bytes", "plot_timeline", "on_host", "on_disk", "budget_active", "budget_bytes"]

KINDS = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries")
PHASES = ("forward", "backward", "optimizer")
_PARAM, _BUF, _GRAD, _OPT, _ACT, _TEMP = range(6)    # label priority: a lower number wins
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(limit: int | float | str) -> int:
    """Bytes from an int or a string such as "512 MiB", "2 GB", "1.5GiB" (GB = 10⁹, GiB = 2³⁰)."""
    if isinstance(limit, bool) or not isinstance(limit, (int, float, str)):
        raise TypeError(f"a memory size is bytes (int) or a string like '512 MiB', got {limit!r}")
    if isinstance(limit, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", limit)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {limit!r} as a size: write e.g. '512 MiB' or '2 GB'")
        limit = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if limit < 0:
        raise ValueError(f"a memory size cannot be negative, got {limit}")
    return int(limit)


def format_bytes(n: float) -> str:
    """A byte count for people: 1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _aliases_only(func) -> bool:
    """True for operators whose outputs all alias an input (views, in-place): they allocate nothing."""
    returns = func._schema.returns
    return (bool(returns) and all(r.alias_info is not None for r in returns)
            and "lift_fresh" not in func.__name__        # torch.tensor(data) arrives through it
            and "resize" not in func.__name__ and not func.__name__.startswith("set_")
            and func._overloadname != "out")


class _Ledger(TorchDispatchMode):
    """Every live storage on one device type that operators returned inside the block, counted once."""

    def __init__(self, device_type: str, limit: int | None = None):
        super().__init__()
        self.device_type, self.limit = device_type, limit
        # Flat arrays and int-valued dicts, no object per event: long-lived containers would make
        # Python's garbage collector rescan the heap again and again, slowing every step.
        self.ids: dict[int, int] = {}            # live storage address -> storage id
        self.refs: dict[weakref.ref, int] = {}   # weak ref on the storage -> its address
        self.size = array.array("q")             # storage id -> bytes
        self.kind = bytearray()                  # storage id -> label (lower wins)
        self.ev_id, self.ev_delta = array.array("q"), array.array("q")   # one entry per event:
        self.ev_phase = bytearray()              # which storage, +-bytes, in which phase
        self.where = bytearray()                 # storage id -> _DEVICE or _HOST
        self.owner = array.array("i")            # storage id -> module running its forward
        self.module = 0                          # that module's number (0: none; `track(modules=)`)
        self.bytes = self.peak = self.peak_event = 0
        self.host_bytes = self.host_peak = self.host_peak_event = 0
        self.in_optimizer = False

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False        # no torch.compile wrapper around every call: it doubled the overhead

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = _ALIASES.get(func)
        if aliases is None:
            aliases = _ALIASES[func] = _aliases_only(func)
        if aliases:
            return out
        before = self.bytes
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self._add(t)
            elif isinstance(t, (tuple, list)):
                for u in t:
                    if isinstance(u, torch.Tensor):
                        self._add(u)
        if self.limit is not None and self.bytes > self.limit:
            asked = self.bytes - before
            t = u = out = None             # drop every reference: the new storages are freed now
            raise torch.OutOfMemoryError(
                f"{self.device_type.upper()} out of memory (memory_budget). Tried to allocate "
                f"{format_bytes(asked)}; {format_bytes(before)} already allocated; budget "
                f"{format_bytes(self.limit)}. Shrink the batch, or free tensors you no longer need.")
        return out

    def _add(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):      # sparse and other storage-less tensors
            return
        key = storage._cdata
        sid = self.ids.get(key)
        nbytes = storage.nbytes()
        if sid is not None:                              # known storage; an out= op may resize it
            if self.size[sid] != nbytes:
                self._record(sid, nbytes - self.size[sid])
                self.size[sid] = nbytes
            return
        where = storage_place(t.device.type, self.device_type)   # a FakeTensor's storage is meta
        if where is None or where > _HOST:               # another device, or a file on disk
            return
        sid = len(self.size)
        self.size.append(nbytes)
        self.kind.append(_TEMP)
        self.where.append(where)
        self.owner.append(self.module)
        self.ids[key] = sid
        self.refs[weakref.ref(storage, self._freed)] = key
        self._record(sid, nbytes)

    def _freed(self, ref: weakref.ref) -> None:
        sid = self.ids.pop(self.refs.pop(ref, None), None)
        if sid is not None:
            self._record(sid, -self.size[sid])

    def _record(self, sid: int, delta: int) -> None:
        self.ev_id.append(sid)
        self.ev_delta.append(delta)
        self.ev_phase.append(2 if self.in_optimizer else                 # 1: inside backward
                             int(torch._C._current_graph_task_id() != -1))
        if self.where[sid] == _HOST:
            self.host_bytes += delta
            if self.host_bytes > self.host_peak:
                self.host_peak, self.host_peak_event = self.host_bytes, len(self.ev_id)
            return
        self.bytes += delta
        if self.bytes > self.peak:
            self.peak, self.peak_event = self.bytes, len(self.ev_id)

    def label(self, t: Any, kind: int) -> None:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            sid = self.ids.get(t.untyped_storage()._cdata)
            if sid is not None and kind < self.kind[sid]:
                self.kind[sid] = kind

    def add_existing(self, t: Any, kind: int) -> None:
        """Count a tensor made before the block (`track(external=...)`) and label it."""
        if isinstance(t, torch.Tensor) and t.layout == torch.strided:
            self._add(t)
            self.label(t, kind)

    def replay(self, stop: int | None = None, where: int = _DEVICE
               ) -> Iterator[tuple[int, int, int]]:
        """(label, +-bytes, phase) of each device (or host) event up to `stop`, labels as now."""
        kind, at = self.kind, self.where
        for sid, delta, phase in zip(self.ev_id[:stop], self.ev_delta[:stop], self.ev_phase[:stop]):
            if at[sid] == where:
                yield kind[sid], delta, phase

    def close(self) -> None:
        """Stop counting: later frees no longer change the figures."""
        self.refs.clear()
        self.ids.clear()


_ALIASES: dict[Any, bool] = {}


@contextlib.contextmanager
def _labels(ledger: _Ledger) -> Iterator[None]:
    """Label storages by kind: module parameters on each forward, gradients and optimizer state
    around each optimizer step, tensors saved for backward as they are packed."""
    modules, optimizers = weakref.WeakSet(), weakref.WeakSet()

    def label_module(module, inputs=None):
        modules.add(module)
        for p in module._parameters.values():
            if p is not None:
                ledger.label(p, _PARAM)
                ledger.label(p.grad, _GRAD)
        for b in module._buffers.values():
            ledger.label(b, _BUF)

    def before_step(opt, args=None, kwargs=None):
        optimizers.add(opt)
        ledger.in_optimizer = True
        for group in opt.param_groups:
            for p in group["params"]:
                ledger.label(p, _PARAM)
                ledger.label(p.grad, _GRAD)

    def after_step(opt, args=None, kwargs=None):
        ledger.in_optimizer = False
        for state in opt.state.values():
            for value in state.values():
                ledger.label(value, _OPT)

    def pack(t):
        # A parameter is an nn.Parameter (modules' and the optimizers' are labelled by the hooks
        # too), not any leaf that requires grad: Hugging Face's enable_input_require_grads makes
        # a frozen embedding's output one, and it is an activation.
        ledger.label(t, _PARAM if isinstance(t, torch.nn.Parameter) else _ACT)
        if isinstance(t, FakeTensor):            # its fake mode must see the detach, or the
            return t.detach()                    # copy comes back a plain meta tensor
        with torch._C._DisableTorchDispatch():   # detach allocates nothing: skip the ledger
            return t.detach()      # same storage; a detached copy keeps autograd's graph acyclic

    handles = [register_module_forward_pre_hook(label_module),
               register_optimizer_step_pre_hook(before_step),
               register_optimizer_step_post_hook(after_step)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for handle in handles:
            handle.remove()
        for module in list(modules):
            label_module(module)
        for opt in list(optimizers):
            before_step(opt)
            after_step(opt)


def _external(ledger: _Ledger, external: Any) -> None:
    """Count the model states that exist before the block: parameters, buffers and gradients of
    each module, and each optimizer's parameters, gradients and state."""
    items = external if isinstance(external, (tuple, list)) else (external,)
    for item in items:
        if isinstance(item, torch.nn.Module):
            params, buffers, states = list(item.parameters()), list(item.buffers()), []
        elif isinstance(item, torch.optim.Optimizer):
            params = [p for group in item.param_groups for p in group["params"]]
            buffers, states = [], [v for state in item.state.values() for v in state.values()]
        else:
            raise TypeError("external= takes a model (nn.Module), an optimizer, or a tuple of "
                            f"them, e.g. external=(model, optimizer); got {type(item).__name__}")
        for p in params:
            ledger.add_existing(p, _PARAM)
            ledger.add_existing(p.grad, _GRAD)
        for b in buffers:
            ledger.add_existing(b, _BUF)
        for v in states:
            ledger.add_existing(v, _OPT)


@contextlib.contextmanager
def _module_view(ledger: _Ledger, root: torch.nn.Module, rows: dict[str, dict]) -> Iterator[None]:
    """Fill `rows`: for each submodule of `root`, the live bytes before and after its first
    forward and its first backward; and number the modules, so that each new storage records
    the innermost module whose forward made it."""
    if not isinstance(root, torch.nn.Module):
        raise TypeError(f"modules= takes the model (an nn.Module), got {type(root).__name__}")
    stack: list[int] = []
    handles = []

    def note(row: dict, key: str) -> None:
        if row[key] is None:
            row[key] = ledger.bytes

    def tensors(value) -> list[torch.Tensor]:
        value = value if isinstance(value, (tuple, list)) else (value,)
        return [t for t in value if isinstance(t, torch.Tensor) and t.requires_grad]

    for number, (name, module) in enumerate(root.named_modules(), start=1):
        row = rows[name or "(model)"] = {"number": number, "forward_before": None,
                                         "forward_after": None, "backward_before": None,
                                         "backward_after": None}

        def pre(module, args, row=row, number=number):
            note(row, "forward_before")
            stack.append(ledger.module)
            ledger.module = number
            inputs = tensors(args)
            if inputs and row["backward_after"] is None:      # grads of the inputs: its backward ends
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, lambda grads, row=row: note(row, "backward_after"), mode="any")

        def post(module, args, output, row=row):
            note(row, "forward_after")
            ledger.module = stack.pop() if stack else 0
            outputs = tensors(output)
            if outputs and row["backward_before"] is None:    # grads of the outputs: it begins
                torch.autograd.graph.register_multi_grad_hook(
                    outputs, lambda grads, row=row: note(row, "backward_before"), mode="any")

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        ledger.module = 0


class MemoryTracker:
    """What one block used: `current` and `peak` bytes above what was live on entry, plus
    `breakdown()` by kind and `timeline()` by phase. Made by `track`; read it during or after."""

    def __init__(self, device: torch.device):
        self.device = device
        self._ledger = _Ledger(device.type)
        self._cuda_base: int | None = None
        self._cuda_peak_seen = 0          # the allocator's peak before a nested tracker reset it
        self._final: tuple[int, int, int, int] | None = None
        self._modules: dict[str, dict] = {}     # filled by track(modules=model)
        self.result: Any = None        # what the measured function returned (set by `measure`)

    @property
    def current(self) -> int:
        """Bytes allocated inside the block and still live (at exit, once the block is over)."""
        if self._final is not None:
            return self._final[0]
        if self._cuda_base is not None:
            return torch.cuda.memory_allocated(self.device) - self._cuda_base
        return self._ledger.bytes

    @property
    def peak(self) -> int:
        """The most bytes live at once inside the block, above what was live on entry."""
        if self._final is not None:
            return self._final[1]
        if self._cuda_base is not None:
            return max(self._cuda_peak_seen,
                       torch.cuda.max_memory_allocated(self.device)) - self._cuda_base
        return self._ledger.peak

    @property
    def host_current(self) -> int:
        """Host bytes allocated inside the block and still live (see `on_host`)."""
        return self._final[2] if self._final is not None else self._ledger.host_bytes

    @property
    def host_peak(self) -> int:
        """The most host bytes live at once inside the block; never part of `peak`."""
        return self._final[3] if self._final is not None else self._ledger.host_peak

    @property
    def peak_phase(self) -> str | None:
        """The phase ("forward", "backward", "optimizer") in which the ledger's peak fell."""
        ledger = self._ledger
        return PHASES[ledger.ev_phase[ledger.peak_event - 1]] if ledger.peak_event else None

    @property
    def reserved(self) -> int | None:
        """CUDA only: bytes the caching allocator holds from the driver (allocated + cached)."""
        return torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else None

    @property
    def peak_reserved(self) -> int | None:
        """CUDA only: the most bytes the caching allocator held since the block began."""
        return torch.cuda.max_memory_reserved(self.device) if self.device.type == "cuda" else None

    def breakdown(self, at: str = "peak", *, where: str = "device") -> dict[str, int]:
        """Bytes by kind (`KINDS`) at the peak of the block, or at its end with at="current";
        of device memory, or of host memory with where="host" (at the host's own peak).

        On CUDA the kinds add up to the ledger's count of tensor storages, which is slightly below
        the allocator's figure (the allocator rounds each block up to 512 bytes)."""
        if at not in ("peak", "current"):
            raise ValueError(f'at must be "peak" or "current", got {at!r}')
        if where not in ("device", "host"):
            raise ValueError(f'where must be "device" or "host", got {where!r}')
        ledger, host = self._ledger, where == "host"
        stop = (ledger.host_peak_event if host else ledger.peak_event) if at == "peak" else None
        totals = [0] * len(KINDS)
        for kind, delta, _ in ledger.replay(stop, _HOST if host else _DEVICE):
            totals[kind] += delta
        return dict(zip(KINDS, totals))

    def modules(self) -> dict[str, dict[str, int | None]]:
        """With `track(modules=model)`: for each submodule (by name; the model itself is
        "(model)"), `at_peak`, the device bytes live at the peak that were made while the module
        was the innermost one running forward (its outputs and saved tensors), and the live bytes
        before and after its first forward and first backward (None where it had none: a module
        whose inputs need no gradient records no end of backward). CPU ledger bytes on the CPU;
        on CUDA the same ledger's count of storages."""
        if not self._modules:
            raise ValueError("no per-module view: track with modules=model, e.g. "
                             "with track(modules=model) as t: ...")
        ledger = self._ledger
        live = [0] * (len(self._modules) + 1)
        for sid, delta in zip(ledger.ev_id[:ledger.peak_event], ledger.ev_delta[:ledger.peak_event]):
            if ledger.where[sid] == _DEVICE:
                live[ledger.owner[sid]] += delta
        return {name: {"at_peak": live[row["number"]],
                       **{k: v for k, v in row.items() if k != "number"}}
                for name, row in self._modules.items()}

    def timeline(self) -> dict[str, list]:
        """Live bytes after each allocation or free, by kind, with the phase it happened in.

        Returns {"event": [0, 1, ...], "phase": ["forward", ...], "total": [...], and one list per
        kind}: the data behind `plot_timeline`."""
        totals = [0] * len(KINDS)
        out: dict[str, list] = {"event": [], "phase": [], "total": [], **{k: [] for k in KINDS}}
        running = 0
        for i, (kind, delta, phase) in enumerate(self._ledger.replay()):
            totals[kind] += delta
            running += delta
            out["event"].append(i)
            out["phase"].append(PHASES[phase])
            out["total"].append(running)
            for name, value in zip(KINDS, totals):
                out[name].append(value)
        return out

    def __str__(self) -> str:
        lines = [f"memory on {self.device}: peak {format_bytes(self.peak)}, "
                 f"live at end {format_bytes(self.current)}"]
        if self.host_peak:
            lines[0] += (f"; host: peak {format_bytes(self.host_peak)}, "
                         f"live at end {format_bytes(self.host_current)}")
        lines += [f"  {kind:<16}{format_bytes(n):>12}" for kind, n in self.breakdown().items()]
        return "\n".join(lines)

    __repr__ = __str__


@contextlib.contextmanager
def track(device: torch.device | str | None = None, *, external: Any = None,
          modules: torch.nn.Module | None = None) -> Iterator[MemoryTracker]:
    """Measure the memory a block allocates on `device` (CUDA when present, else the CPU).

        >>> with track("cpu") as t:
        ...     x = torch.empty(1000)          # 4000 bytes
        ...     y = x.view(10, 100)            # a view: no new storage
        >>> t.current, t.peak                  # (4000, 4000)

    On CUDA, `current` and `peak` come from the caching allocator (peaks reset on entry) and
    `reserved` says what it holds; on the CPU they come from the ledger of live storages.

    A model built before the block is invisible to it: pass `external=(model, optimizer)` (a
    module, an optimizer, or a tuple of them) and its parameters, buffers, gradients and optimizer
    state are counted from the start, by kind, as torch's `MemTracker.track_external` does.
    `modules=model` adds a per-module view (`MemoryTracker.modules`)."""
    device = _device(device)
    tracker = MemoryTracker(device)
    ledger = tracker._ledger
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for outer in _CUDA_TRACKERS:            # a nested tracker resets the allocator's peak:
            outer._cuda_peak_seen = max(outer._cuda_peak_seen,   # the outer ones keep theirs
                                        torch.cuda.max_memory_allocated(outer.device))
        torch.cuda.reset_peak_memory_stats(device)
        tracker._cuda_base = torch.cuda.memory_allocated(device)
        _CUDA_TRACKERS.append(tracker)
    try:
        with ledger, _labels(ledger), (_module_view(ledger, modules, tracker._modules)
                                       if modules is not None else contextlib.nullcontext()):
            if external is not None:
                _external(ledger, external)
                if tracker._cuda_base is not None:     # the allocator counted them already
                    tracker._cuda_base -= ledger.bytes
            yield tracker
    finally:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tracker._final = (tracker.current, tracker.peak, ledger.host_bytes, ledger.host_peak)
        if tracker in _CUDA_TRACKERS:
            _CUDA_TRACKERS.remove(tracker)
        ledger.close()


# The CUDA trackers open now, outermost first: when one more starts, it resets the allocator's
# peak counter, so each open one first keeps the peak it has seen so far.
_CUDA_TRACKERS: list[MemoryTracker] = []


def measure(fn: Callable, *args, device: torch.device | str | None = None, external: Any = None,
            **kwargs) -> MemoryTracker:
    """Run `fn(*args, **kwargs)` once under `track(device, external=external)` and return the
    tracker (its report); the function's return value is kept as `tracker.result`."""
    with track(device, external=external) as tracker:
        tracker.result = fn(*args, **kwargs)
    return tracker


@contextlib.contextmanager
def memory_budget(limit: int | str, device: torch.device | str | None = None) -> Iterator[None]:
    """Fail like a GPU when the block allocates more than `limit` (bytes, or "512 MiB", "2 GB").

    On the CPU, the operator whose result takes the bytes allocated inside the block over `limit`
    raises `torch.OutOfMemoryError` ("Tried to allocate X; Y already allocated; budget Z"). On CUDA
    the caching allocator's own cap (`set_per_process_memory_fraction`) is set to what the process
    holds on entry plus `limit`. Either way the same `except torch.OutOfMemoryError:` catches it,
    and on exit, normal or not, the hook and the limit are gone.

        >>> with memory_budget("1 MiB"):
        ...     torch.empty(2**20)             # 4 MiB: torch.OutOfMemoryError
    """
    limit, device = parse_bytes(limit), _device(device)
    if device.type != "cuda":
        with _Ledger(device.type, limit=limit) as ledger:
            try:
                yield
            finally:
                ledger.close()
        return
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = getter(device) if getter is not None else 1.0
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, (torch.cuda.memory_reserved(device) + limit) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


def _budgets() -> list[_Ledger]:
    return [m for m in _get_current_dispatch_mode_stack()
            if isinstance(m, _Ledger) and m.limit is not None]


def budget_active() -> bool:
    """True inside `memory_budget` on the CPU (its ledger is among the active dispatch modes)."""
    return bool(_budgets())


def budget_bytes() -> int:
    """Bytes the innermost active CPU `memory_budget` counts now (0 outside one)."""
    budgets = _budgets()
    return budgets[-1].bytes if budgets else 0


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device
