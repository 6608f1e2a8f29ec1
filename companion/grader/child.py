"""The learner's side of the grader: one sandboxed interpreter per notebook.

    python -m companion.grader.child FD_IN FD_OUT LIMITS_JSON      (started by `sandbox.Child`)

It applies its limits before any learner code runs, then serves the grader's requests: execute a
cell's code in IPython (so %magics and %%worker_module work), say what a name is, run the learner's
answer (or a check's @harness) on arguments the grader sent. It replies with plain data only and
holds no verdict: the grader decides. Everything here runs beside the learner's code and can be
changed by it, so nothing it says is trusted beyond being plain data.
"""
from __future__ import annotations

import collections
import importlib
import inspect
import json
import os
import pickle
import pkgutil
import resource
import signal
import sys
import threading
import traceback
from typing import Any

from companion.grader import wire

_MISSING = object()


def _apply_limits(limits: dict) -> None:
    """Hard limits: the soft and hard values both set, so the learner's code cannot raise them."""
    pairs = {"memory": resource.RLIMIT_AS, "file_size": resource.RLIMIT_FSIZE,
             "processes": resource.RLIMIT_NPROC}
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for key, which in pairs.items():
        if limits.get(key):
            resource.setrlimit(which, (int(limits[key]), int(limits[key])))
        elif key == "memory":                 # no cap: lift the grading process's soft one
            resource.setrlimit(which, (resource.getrlimit(which)[1],) * 2)


def _error_text(error: BaseException | None) -> str:
    return "" if error is None else f"{type(error).__name__}: {error}"[:2000]


class Server:
    def __init__(self, shell):
        self.shell = shell

    # ------------------------------------------------------------ requests

    def handle(self, request: dict) -> dict:
        op = request.get("op")
        if op == "exec":
            signal.signal(signal.SIGINT, signal.default_int_handler)   # the grader's interrupt
            try:
                result = self.shell.run_cell(request["source"], store_history=True)
            finally:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            error = result.error_before_exec or result.error_in_exec
            return {"status": "error" if error else "ok", "error": _error_text(error)}
        if op == "resolve":
            return self.resolve(request["name"])
        if op == "run":
            return self.run(request)
        return {"status": "raised", "type": "GraderError", "message": f"unknown request {op!r}"}

    def resolve(self, name: str) -> dict:
        value = self.shell.user_ns.get(name, _MISSING)
        if value is _MISSING:
            return {"status": "ok", "kind": "missing"}
        if callable(value):
            return {"status": "ok", "kind": "callable"}
        return {"status": "ok", "kind": "value", "value": wire.encode(value)}

    def answer(self, name: str, via) -> Any:
        value = self.shell.user_ns.get(name, _MISSING)
        if value is _MISSING:
            raise NameError(f"name {name!r} is not defined")
        return _target(*via)(value) if via else value

    def run(self, request: dict) -> dict:
        from companion.checks.core import CheckFailed, _TimeUp, learner_frames, time_limit
        args, kwargs = wire.answer_unpickler(request["args"], self.answer)
        fn = _target(*request["target"])
        before = _snapshot(args, kwargs)
        monitor = _Monitor(request.get("references", ()))
        try:
            with monitor, time_limit(max(request["timeout"], 0.01)):
                value = fn(*args, **kwargs)
        except CheckFailed as failure:
            return {"status": "failed", "kind": type(failure).__name__, "summary": failure.summary,
                    "hint": failure.hint, "where": list(failure.where), "seed": failure.seed,
                    "expected": _shown(failure.expected), "got": _shown(failure.got),
                    "max_diff": failure.max_diff, "references": monitor.hits}
        except _TimeUp as stopped:
            return {"status": "timeout", "where": learner_frames(stopped, limit=1),
                    "references": monitor.hits}
        except BaseException as e:               # SystemExit, KeyboardInterrupt, a harness bug
            return {"status": "raised", "type": type(e).__name__, "message": str(e)[:2000],
                    "where": learner_frames(e), "references": monitor.hits}
        return {"status": "ok", "value": wire.encode(value), "references": monitor.hits,
                "changed": _changes(before, args, kwargs)}


def _shown(value: Any) -> str | None:
    if value is None:
        return None
    from companion.checks.core import _short
    return _short(value, limit=400)


_TARGETS: dict[tuple[str, str], Any] = {}      # taken before any learner code ran


def _capture(modules: list[str]) -> None:
    """Import the chapter's check modules and keep their functions as they are now: a cell that
    rebinds `core.call` or a harness later does not change what the grader's requests run."""
    names = ["companion.checks.core", *modules]
    for name in names:
        module = importlib.import_module(name)
        names += [f"{name}.{m.name}" for m in      # a chapter split into one module per
                  pkgutil.iter_modules(getattr(module, "__path__", []))]   # exercise
        for attr, value in vars(module).items():
            if callable(value) and getattr(value, "__module__", None) == name:
                _TARGETS[name, attr] = _unwrapped(value)


def _withhold(preload: list[str], outside: list[str]) -> None:
    """In a clean room: import the modules whose withheld definitions were emptied (before any
    learner code, so that the copy on disk no longer matters), and replace references outside
    the package with functions that raise."""
    from companion.grader.withhold import MARK
    for name in preload:
        importlib.import_module(name)
    for dotted in outside:
        module_name, attr = dotted.rsplit(".", 1)
        module = importlib.import_module(module_name)

        def withheld(*args, _name=dotted, **kwargs):
            raise RuntimeError(f"{MARK} {_name} is withheld while this exercise is graded on "
                               "its own: the answer must not use it")
        setattr(module, attr, withheld)


def _unwrapped(obj):
    return getattr(obj, "__wrapped__", obj) if getattr(obj, "__companion_harness__", False) else obj


def _target(module: str, qualname: str):
    """The function a request names: core.call, a @harness (undecorated), or a checks helper."""
    if not module.startswith("companion.checks."):
        raise PermissionError(f"{module}.{qualname} is not part of companion.checks")
    if (module, qualname) in _TARGETS:
        return _TARGETS[module, qualname]
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return _unwrapped(obj)


# ---------------------------------------------------------------- arguments changed in place

def _walk(value: Any, path: tuple, depth: int = 0):
    import torch
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, torch.nn.Module):
        yield path, value
    elif depth < 3 and type(value) in (tuple, list):
        for i, v in enumerate(value):
            yield from _walk(v, path + (i,), depth + 1)
    elif depth < 3 and type(value) is dict:
        for k, v in value.items():
            if type(k) in (str, int):
                yield from _walk(v, path + (k,), depth + 1)


def _module_state(module) -> dict:
    state = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}
    grads = {k: None if p.grad is None else p.grad.detach().clone()
             for k, p in module.named_parameters()}
    return {"state": state, "grads": grads}


def _snapshot(args: tuple, kwargs: dict) -> dict:
    import torch
    out = {}
    for path, value in _walk((args, kwargs), ()):
        out[path] = (_module_state(value) if isinstance(value, torch.nn.Module)
                     else value.detach().clone())
    return out


def _same(a, b) -> bool:
    import torch
    if a is None or b is None:
        return a is b
    if a.device.type == "meta" or b.device.type == "meta":     # no data to compare: shapes only
        return a.device == b.device and a.shape == b.shape and a.dtype == b.dtype
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _changes(before: dict, args: tuple, kwargs: dict) -> list:
    """[(path, new value)] for each tensor or module argument the call changed in place."""
    import torch
    changed = []
    for path, value in _walk((args, kwargs), ()):
        if path not in before:
            continue
        if isinstance(value, torch.nn.Module):
            now, then = _module_state(value), before[path]
            diff = {part: {k: now[part][k] for k in now[part]
                           if k not in then[part] or not _same(now[part][k], then[part][k])}
                    for part in ("state", "grads")}
            if diff["state"] or diff["grads"]:
                changed.append((list(path), "module", diff))
        elif not _same(value.detach(), before[path]):
            changed.append((list(path), "tensor", value.detach().clone()))
    return changed


# ---------------------------------------------------------------- calls into the reference

class _Monitor:
    """Counts calls into the given reference functions/classes while the answer runs."""

    def __init__(self, references):
        self.codes = {}
        for dotted in references:
            for code in _codes_of(dotted):
                self.codes[code] = dotted
        self.hits: dict[str, int] = collections.Counter()

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes:
            self.hits[self.codes[frame.f_code]] += 1

    def __enter__(self):
        if self.codes:
            self.previous = sys.getprofile()
            sys.setprofile(self._profile)
            threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        if self.codes:
            sys.setprofile(self.previous)
            threading.setprofile(None)
        self.hits = dict(self.hits)


def _codes_of(dotted: str) -> list:
    from companion.grader.withhold import resolve
    try:
        obj = resolve(dotted)
    except (ImportError, AttributeError):
        return []
    functions = []
    members = vars(obj).values() if isinstance(obj, type) else [obj]
    for member in members:
        for f in (member, getattr(member, "__func__", None), getattr(member, "fget", None)):
            try:
                f = inspect.unwrap(f)      # a decorator's wrapper code is shared: not that one
            except ValueError:
                continue
            if hasattr(f, "__code__"):
                functions.append(f.__code__)
    return functions


# ---------------------------------------------------------------- main

def main(argv: list[str]) -> int:
    fd_in, fd_out, limits = int(argv[0]), int(argv[1]), json.loads(argv[2])
    _apply_limits(limits)
    _capture(limits.get("modules", []))
    _withhold(limits.get("preload", []), limits.get("outside", []))
    signal.signal(signal.SIGINT, signal.SIG_IGN)             # only a running cell is interrupted
    os.set_inheritable(fd_in, False)
    os.set_inheritable(fd_out, False)
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance(colors="NoColor")
    server = Server(shell)
    wire.send(fd_out, wire.dumps({"status": "ready", "uid": os.getuid(), "pid": os.getpid()}))
    while True:
        try:
            request = pickle.loads(wire.receive(fd_in))
        except EOFError:
            return 0
        try:
            body = wire.dumps(server.handle(request))
        except BaseException as e:
            body = wire.dumps({"status": "raised", "type": type(e).__name__,
                               "message": str(e)[:2000], "where": [],
                               "trace": traceback.format_exc()[-2000:]})
        sys.stdout.flush()
        sys.stderr.flush()
        wire.send(fd_out, body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
