"""Running a learner's answer on several gloo ranks, for the checks of chapters 06 and 07.

`packed(answer)` pickles the answer by reference for the workers (or, under the grader, makes a
token for the sandbox); `on_ranks(worker, world_size, ...)` runs `worker` on every rank and turns a
rank's exception or hang into a CheckFailed that names the rank; `rank_tensor` is each rank's data.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable

import torch

from companion import launch
from companion.checks.core import CheckFailed, NotDone, harness, require_function
from companion.checks.harness import Remote

__all__ = ["packed", "on_ranks", "rank_tensor"]


def packed(answer: Any) -> bytes:
    """The answer, pickled by reference for the workers, or a CheckFailed saying how to fix it.
    Under the grader the answer lives in its sandbox: this becomes a token that `on_ranks`
    (a harness, run there) receives as the pickled answer."""
    require_function(answer)
    if isinstance(answer, Remote):
        return answer.through(packed)
    try:
        return pickle.dumps(answer)
    except Exception:
        raise CheckFailed("the worker processes cannot import your function",
                          hint="start the exercise cell with %%worker_module NAME (after "
                               "%load_ext companion.launch), so the workers can import it.") from None


@harness
def on_ranks(worker: Callable, world_size: int, *args, timeout: float) -> list:
    """launch.run, with a rank's exception or hang turned into a CheckFailed naming the rank.
    A harness: under the grader the ranks start in the learner's sandbox."""
    try:
        return launch.run(worker, world_size, *args, timeout=timeout)
    except launch.WorkerTimeout as e:
        raise CheckFailed(f"rank(s) {e.ranks} did not finish within {timeout:g} s",
                          hint="a send without a matching recv (or the reverse) waits forever: "
                               "every rank must post its sends and receives in the same order "
                               "as its neighbours.") from None
    except launch.WorkerError as e:
        last = e.traceback.strip().splitlines()[-1] if e.traceback.strip() else "it died"
        if last.startswith("NotImplementedError"):
            raise NotDone(f"not done yet: your function raises {last}") from None
        where = [ln.strip() for ln in e.traceback.splitlines() if ln.strip().startswith("File")]
        raise CheckFailed(f"rank {e.rank} raised {last}", got=where[-1] if where else None,
                          hint="run your function by hand on a small tensor; the line above is "
                               "where it failed.") from None


def rank_tensor(seed: int, rank: int, numel: int) -> torch.Tensor:
    """Rank `rank`'s own data for a check's collective: drawn from the seed and the rank."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed + 7919 * rank))
