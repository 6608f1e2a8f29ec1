"""What autocast really runs: per operator call, the dtypes of its inputs and output.

A dispatch mode sees the operators after autocast has cast their inputs, so the list is what ran,
not what the lists in the documentation say should run.

Example:
    >>> ops = autocast_dtypes(gpt.loss, x, y)
    >>> {o.op: o.output for o in ops}["addmm"]     # torch.bfloat16

`autocast_ops` reads which operators autocast wraps on a device type from the dispatcher's own
registrations (`aten/src/ATen/autocast_mode.cpp`), which a CPU build holds for CUDA too.

Simplified vs PyTorch: `torch.autocast` decides per operator from its lists ("Autocast Op
Reference"); this only reads the outcome of one forward, it changes nothing.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["OpDtype", "autocast_dtypes", "autocast_ops"]


@dataclasses.dataclass(frozen=True)
class OpDtype:
    """One operator call: its name, the dtypes of its floating-point inputs and its output."""

    op: str
    inputs: tuple[torch.dtype, ...]
    output: torch.dtype


def _is_view(func) -> bool:
    """A view returns an alias of its input that it does not write (no compute). In-place ops
    (relu_, add_: `Tensor(a!)`) return an alias too, but one they wrote: those computed."""
    return func.overloadpacket.__name__.endswith("view") or all(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class _Dtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[OpDtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_leaves(out)
                if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if outs and not _is_view(func):
            ins = tuple(t.dtype for t in tree_leaves((args, kwargs))
                        if isinstance(t, torch.Tensor) and t.is_floating_point())
            self.calls.append(OpDtype(func.overloadpacket.__name__, ins, outs[0].dtype))
        return out


def autocast_dtypes(model: Callable, *inputs, device_type: str = "cpu",
                    dtype: torch.dtype = torch.bfloat16, cache_enabled: bool = True
                    ) -> list[OpDtype]:
    """Run `model(*inputs)` once under `torch.autocast(device_type, dtype)` and list, per operator
    call in order, the dtypes it computed in. Casts autocast inserts show up as `_to_copy`.
    Views are left out; in-place operators (`relu_`) are listed.

    Memory: one forward under autocast, whose outputs are dropped on return.

        >>> ops = autocast_dtypes(gpt.loss, x, y)
        >>> {o.op: o.output for o in ops}["addmm"]     # torch.bfloat16

    Arguments:
        model: any callable (a module, or a bound method such as `gpt.loss`).
        inputs: passed to it positionally.
        device_type, dtype, cache_enabled: as for `torch.autocast` (with the cache, a weight used
            twice in the region is cast once).
    """
    with torch.autocast(device_type, dtype=dtype, cache_enabled=cache_enabled), _Dtypes() as mode:
        model(*inputs)
    return mode.calls


def autocast_ops(device_type: str) -> frozenset[str]:
    """The operators ("aten::name.overload") that `torch.autocast(device_type)` wraps in this build
    of PyTorch: those with a kernel of their own at the AutocastCPU or AutocastCUDA dispatch key,
    whichever list they are on (16-bit, fp32 or promote). Every other operator falls through and
    runs on its inputs as they are. Read from the dispatcher (`torch._C._dispatch_dump_table`), so
    a CPU build answers for "cuda" too; the list an operator is on is in PyTorch's Autocast Op
    Reference, or measured with `autocast_dtypes` on the device itself.

        >>> "aten::index_put" in autocast_ops("cuda"), "aten::index_put_" in autocast_ops("cuda")
        (True, False)
    """
    keys = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU",
            "mps": "AutocastMPS"}
    if device_type not in keys:
        raise ValueError(f"device_type is one of {sorted(keys)}, got {device_type!r}")
    try:
        names, dump = torch._C._dispatch_get_all_op_names, torch._C._dispatch_dump_table
    except AttributeError as e:
        raise RuntimeError("this PyTorch build does not expose its dispatcher's registrations "
                           "(torch._C._dispatch_dump_table): read autocast's lists in its "
                           "Autocast Op Reference instead") from e
    prefix = keys[device_type] + ":"
    return frozenset(name for name in names() for line in dump(name).splitlines()
                     if line.startswith(prefix) and "fallthrough" not in line)
