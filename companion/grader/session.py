"""The notebook's sandbox as the grading process keeps it: started (as the spec's user, with its
environment), restarted when lost with the cells run so far replayed (the one that ended it left
out), at most `_MAX_RESTARTS` times, within the notebook's deadline."""
from __future__ import annotations

import time

from companion.grader.confine import Confinement
from companion.grader.sandbox import Child, ChildLost, Limits

__all__ = ["Session"]

_MAX_RESTARTS = 3


class Session:
    """The notebook's sandbox, restarted (with the cells so far replayed) when it is lost."""

    def __init__(self, spec: dict, limits: Limits, modules: tuple[str, ...] = (), *,
                 env: dict | None = None, user: tuple[int, int] | None = None,
                 withheld: dict | None = None, confine: Confinement | None = None):
        self.spec, self.limits, self.modules = spec, limits, modules
        self.confine = confine if confine is not None else confinement(spec)
        self.env = spec["child_env"] if env is None else env
        self.user = _user(spec) if user is None else user
        self.withheld = withheld
        self.deadline = time.monotonic() + limits.notebook
        self.child: Child | None = None
        self.history: list[str] = []          # code run so far, replayed after a restart
        self.starts, self.losses, self.output_total, self.ran_as = 0, [], 0, None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def lose(self, lost: ChildLost) -> None:
        self._collect()
        self.child = None
        self.losses.append(lost.reason)

    def _collect(self) -> None:
        if self.child is not None:
            self.output_total += self.child.output_total

    def ensure(self) -> bool:
        """A running sandbox with the history replayed, or False when none can be had."""
        while self.child is None:
            if self.starts > _MAX_RESTARTS or self.left() <= 0:
                return False
            self.starts += 1
            child = Child(limits=self.limits, user=self.user, env=self.env,
                          modules=self.modules, withheld=self.withheld, confine=self.confine)
            try:
                self.ran_as = child.start(timeout=min(120.0, self.left())).get("uid")
                self.child = child
                self._replay()
            except ChildLost as lost:
                self.lose(lost)
        return True

    def _replay(self) -> None:
        for source in list(self.history):
            try:
                self.child.request({"op": "exec", "source": source}, interrupt=True,
                                   timeout=min(self.limits.cell, self.left()))
            except ChildLost:
                self.history.remove(source)    # it ended the sandbox again: leave it out
                raise

    def run_cell(self, source: str) -> str:
        """Run code; return '' or what went wrong."""
        if not self.ensure():
            return "not run: " + self.why_stopped()
        try:
            reply = self.child.request({"op": "exec", "source": source}, interrupt=True,
                                       timeout=min(self.limits.cell, self.left()))
        except ChildLost as lost:
            self.lose(lost)
            return f"its cell was stopped: {lost.reason}"
        error = reply.get("error") if type(reply.get("error")) is str else ""
        if reply.get("status") == "raised":             # an interrupt that came just too late
            error = f"{reply.get('type')}: {reply.get('message')}"
        if not error.startswith("KeyboardInterrupt"):       # interrupted at its limit: not again
            self.history.append(source)
        return error and (f"its cell ran past {self.limits.cell:g} s and was interrupted"
                          if error.startswith("KeyboardInterrupt") else error)

    def why_stopped(self) -> str:
        if self.left() <= 0:
            return f"the notebook's time limit ({self.limits.notebook:g} s) ran out"
        return f"the notebook's process was lost {len(self.losses)} times (last: " \
               f"{self.losses[-1] if self.losses else '?'})"

    def close(self) -> None:
        self._collect()
        if self.child is not None:
            self.child.kill()
            self.child = None


def confinement(spec: dict) -> Confinement | None:
    """The spec's kernel sandbox for a notebook's first run, or None (`--trusted`)."""
    c = spec.get("confine")
    return None if not c else Confinement(
        c["bwrap"], hide=tuple(c.get("hide", ())), show=tuple(c.get("show", ())),
        blank=tuple(c.get("blank", ())), disk=int(c.get("disk", 2 * 2**30)))


def _user(spec: dict) -> tuple[int, int] | None:
    return tuple(spec["user"]) if spec.get("user") else None
