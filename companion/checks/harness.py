"""Where a learner's code runs: in the notebook's own process, or in the grader's sandbox.

In a notebook, a check calls the learner's function directly. Under `python -m companion grade`,
the check runs in the grader and the learner's function lives in another process (a sandbox with
hard limits); the check then receives a `Remote` in place of the function. Two doors lead to it:

- `call(answer, *args)` (in core): copies of the arguments are sent to the sandbox, the answer
  runs there, and only its return value comes back, as plain data (tensors, numbers, strings,
  None, and tuples, lists and dicts of them). Tensors and modules the answer changed in place
  are copied back into those copies (with `call_inplace`, into the arguments themselves, made
  for the answer alone), never into what the check computed its expectation from.
- A module-level function marked `@harness`: it takes the answer (or `_packed(answer)`-style
  `answer.through(fn)` tokens) among its arguments, runs the learner's code the way the check
  needs (hooks, callbacks, autograd through the learner's Function, gloo workers) and returns raw
  observations. Under the grader it runs in the sandbox; its arguments must pickle and its return
  value must be plain data. Verdicts (compare, require) stay in the check, outside the harness.

    @harness
    def _observe_step(answer, seed: int, k: int) -> tuple:
        model, x, y = _setup(seed)                    # built here, from the seed
        steps = []
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.register_step_post_hook(lambda *a: steps.append(1))
        call_inplace(answer, model, opt, x, y, k)     # the step changes model in place
        return [p.detach() for p in model.parameters()], len(steps)

Anything else a check does with a Remote (pickling it, reading its attributes) raises
`GraderError`, so a check that would need a harness fails loudly in the grader's report instead
of scoring every learner zero.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["Remote", "RemoteArg", "GraderError", "harness", "remote_in"]


class GraderError(BaseException):
    """The grader cannot run this check in its sandbox: a fault of the check, not of the learner.
    A BaseException, so that the check's `except Exception` cannot turn it into a failed answer."""


class RemoteArg:
    """`fn(answer)`, computed in the sandbox where the answer lives (see `Remote.through`)."""

    def __init__(self, remote: "Remote", fn: Callable):
        self.remote, self.fn = remote, fn

    def __reduce__(self):
        raise GraderError("a packed answer can only be passed to a @harness function")


class Remote:
    """The learner's answer while it lives in another process. The grader subclasses it."""

    def __init__(self, name: str):
        self.name = name

    def call(self, args: tuple, kwargs: dict) -> Any:
        """Run the answer on args in its process; return its result, validated plain data."""
        raise NotImplementedError

    def run_harness(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Run the @harness function fn (undecorated) in the answer's process."""
        raise NotImplementedError

    def limit(self, seconds: float):
        """A context manager: the check's time limit, enforced on the answer's process."""
        raise NotImplementedError

    def through(self, fn: Callable) -> RemoteArg:
        """A token that becomes fn(answer) in the sandbox; fn must be a module-level function."""
        return RemoteArg(self, fn)

    def __call__(self, *args, **kwargs):
        from companion.checks.core import call        # on copies, as every check's call
        return call(self, *args, **kwargs)

    def __reduce__(self):
        raise GraderError(f"the check pickles the answer {self.name!r}; under the grader the "
                          "answer lives in another process: pickle it inside a @harness function "
                          "(or pass answer.through(fn))")

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise GraderError(f"the check reads `answer.{attr}`; under the grader the answer lives in "
                          "another process: do this inside a @harness function")

    def __repr__(self) -> str:
        return f"<your {self.name}>"


def remote_in(args: tuple, kwargs: dict) -> Remote | None:
    """The Remote among args/kwargs (also inside a RemoteArg), or None."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, Remote):
            return value
        if isinstance(value, RemoteArg):
            return value.remote
    return None


def harness(fn: Callable) -> Callable:
    """Mark a module-level function that runs a learner's answer and returns raw observations.

    Called with a plain function (in a notebook, in tests) it simply runs. Called with a `Remote`
    among its arguments (under the grader) it runs in the learner's sandboxed process, and what it
    returns comes back as plain data. Keep verdicts out of it: what it returns is checked by the
    caller, in the grader's own process.
    """
    @functools.wraps(fn)
    def run(*args, **kwargs):
        remote = remote_in(args, kwargs)
        if remote is not None:
            return remote.run_harness(fn, args, kwargs)
        return fn(*args, **kwargs)

    run.__companion_harness__ = True
    return run
