"""A learner's answer as the grader's checks see it: a `Remote` whose calls run in the sandbox.

`SandboxAnswer.call` sends the check's arguments to the sandbox, where the learner's function runs
under the check's time limit, and returns its result after `wire` has made sure it is plain data.
Tensors and modules the answer changed in place are copied back into the arguments it was sent:
copies the check made for it (`core.call`), or objects made for the answer alone
(`core.call_inplace`, whose check reads the changes), never what the check computed its
expectation from. Failures
come back as text and are raised again here as the check's own exceptions; a reply can only ever
make the learner fail, never pass: passing is decided by the check, in this process.
"""
from __future__ import annotations

import contextlib
import io
import time
from typing import Any, Callable

import torch

from companion.checks.core import CheckFailed, NotDone, _TimeUp
from companion.checks.harness import GraderError, Remote
from companion.grader import wire
from companion.grader.sandbox import ChildLost

__all__ = ["SandboxAnswer"]


class _Shown(str):
    """Text from the sandbox shown as-is where a check shows a value."""

    def __repr__(self) -> str:
        return str(self)


def _text(value: Any, limit: int = 2000) -> str:
    return value[:limit] if type(value) is str else ""


def _lines(value: Any) -> list[str]:
    return [_text(v, 300) for v in value[:12]] if type(value) is list else []


class SandboxAnswer(Remote):
    """The answer named `name` in the notebook that `session` runs."""

    def __init__(self, name: str, session, references: tuple[str, ...]):
        super().__init__(name)
        self.session, self.references = session, references
        self.deadline: float | None = None
        self.hits: dict[str, int] = {}

    @contextlib.contextmanager
    def limit(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self.deadline = None

    def call(self, args: tuple, kwargs: dict) -> Any:
        from companion.checks.core import _invoke      # `call` made the copies, here
        return self._run(_invoke, (self, *args), kwargs)

    def run_harness(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        return self._run(fn, args, kwargs)

    # ------------------------------------------------------------ one request

    def _run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        left = (self.deadline - time.monotonic()) if self.deadline else self.session.limits.exercise
        if left <= 0:
            raise _TimeUp(where=[])
        body = self._pickled(fn, args, kwargs)
        child = self.session.child
        if child is None:
            raise CheckFailed("the notebook's process was lost earlier in this check")
        try:
            reply = child.request({"op": "run", "target": (fn.__module__, fn.__qualname__),
                                   "args": body, "timeout": left, "references": self.references},
                                  timeout=left + self.session.limits.grace)
        except ChildLost as lost:
            self.session.lose(lost)
            if lost.refused:
                raise CheckFailed(f"the grader refused what your function returned: {lost.reason}",
                                  hint="return the values the docstring asks for, not more.") \
                    from None
            if lost.timed_out:
                raise _TimeUp(where=["  (the grader ended the notebook's process: the code did "
                                     "not stop at its time limit)"]) from None
            raise CheckFailed(f"the notebook's process ended while your code ran: {lost.reason}",
                              hint="look for os._exit, sys.exit or a crash in your function.") \
                from None
        self._count(reply.get("references"))
        return self._result(reply, args, kwargs)

    def _pickled(self, fn: Callable, args: tuple, kwargs: dict) -> bytes:
        buffer = io.BytesIO()
        try:
            wire.AnswerPickler(buffer).dump((args, kwargs))
        except GraderError:
            raise
        except Exception as e:
            raise GraderError(f"{fn.__qualname__} gets an argument that cannot be sent to the "
                              f"learner's process ({type(e).__name__}: {e}); run that part of the "
                              "check in a @harness function") from None
        return buffer.getvalue()

    def _count(self, references: Any) -> None:
        if type(references) is dict:
            for name, n in references.items():
                if type(name) is str and type(n) is int and n > 0:
                    self.hits[name] = self.hits.get(name, 0) + n

    def _result(self, reply: dict, args: tuple, kwargs: dict) -> Any:
        status = reply.get("status")
        if status == "ok":
            _apply(reply.get("changed"), (args, kwargs))
            return reply.get("value")
        if status == "failed":
            kind = NotDone if reply.get("kind") == "NotDone" else CheckFailed
            max_diff, seed = reply.get("max_diff"), reply.get("seed")
            raise kind(_text(reply.get("summary")) or "failed", hint=_text(reply.get("hint")),
                       where=_lines(reply.get("where")),
                       expected=_Shown(reply["expected"]) if type(reply.get("expected")) is str
                       else None,
                       got=_Shown(reply["got"]) if type(reply.get("got")) is str else None,
                       max_diff=max_diff if type(max_diff) is float else None,
                       seed=seed if type(seed) is int else None)
        if status == "timeout":
            raise _TimeUp(where=_lines(reply.get("where")))
        if status == "raised":
            name = "".join(c for c in _text(reply.get("type"), 60) if c.isalnum() or c == "_")
            message = _text(reply.get("message"))
            if name in ("SystemExit", "KeyboardInterrupt", "GeneratorExit"):
                raise CheckFailed(f"your function raised {name}: {message}",
                                  where=_lines(reply.get("where")))
            raise type(name or "Error", (Exception,), {})(message)
        raise CheckFailed("the notebook's process sent a reply the grader does not understand")


def _apply(changed: Any, root: tuple) -> None:
    """Copy tensors and module states the answer changed in place into the arguments it was sent
    (the check's copies, or objects made for the answer: see `core.call_inplace`)."""
    for item in changed if type(changed) is list else []:
        if type(item) is not tuple or len(item) != 3 or type(item[0]) is not list:
            continue
        path, kind, value = item
        target = root
        try:
            for key in path:
                target = target[key]
        except (KeyError, IndexError, TypeError):
            continue
        with torch.no_grad():
            if kind == "tensor" and isinstance(target, torch.Tensor) and \
                    type(value) is torch.Tensor:
                _copy_into(target, value)
            elif kind == "module" and isinstance(target, torch.nn.Module) and type(value) is dict:
                _module_into(target, value)


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    if target.shape == value.shape and target.dtype == value.dtype:
        target.copy_(value)
    else:
        target.data = value


def _module_into(module: torch.nn.Module, value: dict) -> None:
    state = module.state_dict(keep_vars=True)
    for key, tensor in (value.get("state") or {}).items():
        if key in state and type(tensor) is torch.Tensor:
            _copy_into(state[key], tensor)
    params = dict(module.named_parameters())
    for key, grad in (value.get("grads") or {}).items():
        if key not in params:
            continue
        if grad is None:
            params[key].grad = None
        elif type(grad) is torch.Tensor and grad.shape == params[key].shape and \
                grad.dtype == params[key].dtype:
            params[key].grad = grad
