"""The grading core: how every exercise check runs, compares, times out and reports.

A check is one function per exercise, written with the `exercise` decorator:

    @exercise(points=2)
    def check_mse_gradient(answer):
        for seed in fresh_seeds(3):
            X, y, w, b = make_inputs(seed)
            want, wrong = reference(X, y, w, b), {"Divide by m: the loss is a mean.": ...}
            got = call(answer, X, y, w, b)          # the answer gets copies of X, y, w, b
            compare(got, want, name="(dw, db)", known_wrong=wrong)
        return "matches the reference on 3 random batches"

The expectation is computed first, and the answer runs on copies (`call`): an answer that changes
its inputs (`X.zero_()`, `w.data = ...`) changes nothing the check compares. An answer that must
change its arguments in place gets objects made for it alone (`call_inplace`).

The decorator gives every check the same contract: whatever the learner passes (None, a string, a
function that raises or never returns, a wrong shape, dtype or NaN), the check either passes or
raises `CheckFailed` with what was expected, what came back, the largest difference and a hint,
within its time limit. No other exception escapes, and garbage never passes.

An exercise not written yet (its stub raises NotImplementedError) is not a wrong answer: the check
shows a "not done yet" notice, scores nothing and returns normally, so "Run All" reaches the end of
the notebook. When the learner's own code raises, the failure names the cell and line it came from.
"""
from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import functools
import html
import pathlib
import random
import re
import signal
import sysconfig
import threading
import traceback
from typing import Any, Callable, Iterator

import torch

from companion.checks.harness import GraderError, Remote, harness

__all__ = [
    "CheckFailed",
    "NotDone",
    "GraderError",
    "exercise",
    "evaluate",
    "harness",
    "call",
    "call_inplace",
    "compare",
    "require",
    "require_function",
    "fresh_seeds",
    "seeded",
    "time_limit",
    "REGISTRY",
    "RESULT_MIME",
    "MEASURES_ACTIVATIONS",
]

RESULT_MIME = "application/vnd.companion.check+json"
REGISTRY: dict[str, "CheckInfo"] = {}

# What measures the bytes saved for backward (an exercise asking for that count withholds them)
MEASURES_ACTIVATIONS = ("companion.memory.track", "companion.memory.measure",
                        "companion.memory.memory_budget", "companion.memory.budget_bytes",
                        "companion.checkpointing.activation_bytes",
                        "companion.checkpointing.saved_for_backward")


class CheckFailed(AssertionError):
    """An exercise check did not pass. The message says what was expected, what came back, and why."""

    def __init__(self, summary: str, *, check: str = "", expected: Any = None, got: Any = None,
                 max_diff: float | None = None, hint: str = "", seed: int | None = None,
                 where: list[str] | None = None):
        self.summary, self.check, self.hint, self.seed = summary, check, hint, seed
        self.expected, self.got, self.max_diff = expected, got, max_diff
        self.where = where or []       # the learner's own frames: "Cell In[5], line 3", the line
        super().__init__(summary)

    def lines(self) -> list[str]:
        out = [f"{self.check or 'check'}: {self.summary}"]
        out += self.where
        if self.expected is not None:
            out.append(f"  expected: {_short(self.expected)}")
        if self.got is not None:
            out.append(f"  got:      {_short(self.got)}")
        if self.max_diff is not None:
            out.append(f"  largest difference: {self.max_diff:.3g}")
        if self.seed is not None:
            out.append(f"  (inputs drawn with seed {self.seed})")
        if self.hint:
            out.append(f"  hint: {self.hint}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a traceback: the message in red, nothing else."""
        first, *rest = self.lines()
        return ["\x1b[1;31m✗ " + first + "\x1b[0m"] + [f"\x1b[31m{line}\x1b[0m" for line in rest]


class NotDone(CheckFailed):
    """The exercise still raises NotImplementedError: the learner has not written it yet.
    Raised inside a check; the `exercise` wrapper turns it into a notice, not an error."""


class _TimeUp(BaseException):
    """Raised inside the learner's code when its time is up. BaseException, so `except Exception` in
    the learner's code cannot swallow it. `where`: the learner's frames, when they were taken in
    another process (the grader's sandbox)."""

    def __init__(self, *args, where: list[str] | None = None):
        super().__init__(*args)
        self.where = where


@dataclasses.dataclass(frozen=True)
class CheckInfo:
    name: str
    points: int
    timeout: float
    module: str                         # the chapter's check module (its package, when split)
    reference: tuple[str, ...] = ()     # companion functions an answer must not call
    function: Callable | None = dataclasses.field(default=None, compare=False, repr=False)


# ---------------------------------------------------------------- running the learner's code

@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise `_TimeUp` in this thread if the block runs longer than `seconds`.

    On the main thread of a Unix process it uses SIGALRM, which also interrupts `time.sleep` and
    blocking waits. Elsewhere a watchdog thread injects the exception into this thread, which stops
    any Python loop (a single long C call finishes first).
    """
    if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
        def on_alarm(signum, frame):
            raise _TimeUp()
        old_handler = signal.signal(signal.SIGALRM, on_alarm)
        old_timer = signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_handler)
            if old_timer[0] > 0:
                signal.setitimer(signal.ITIMER_REAL, *old_timer)
        return
    target = ctypes.c_ulong(threading.get_ident())
    done = threading.Event()

    def watchdog():
        if not done.wait(seconds):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(target, ctypes.py_object(_TimeUp))

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def require_function(answer: Any) -> None:
    """Fail unless the learner passed a function (not None, not its result)."""
    if answer is None:
        raise CheckFailed("got None: pass your function (its name, without calling it).")
    if not callable(answer):
        raise CheckFailed(f"expected a function, got a {type(answer).__name__}: {_short(answer)}",
                          hint="pass the function itself, e.g. check(my_fn), not check(my_fn(...)).")


def call(answer: Any, *args, **kwargs) -> Any:
    """Call the learner's function on copies of the arguments; turn anything it does wrong into a
    CheckFailed that says so. Under the grader the answer is a `Remote`: it runs in its sandbox
    and its result comes back.

    The answer gets copies (`_copied`): whatever it does to them (`x.zero_()`, `x.data = ...`, a
    module's weights changed), the check's own objects, and the expectation computed from them,
    stay as they were. An exercise whose answer must change its arguments in place uses
    `call_inplace`."""
    require_function(answer)
    args, kwargs = _copied(args, kwargs)
    return _invoke(answer, *args, **kwargs)


def call_inplace(answer: Any, *args, **kwargs) -> Any:
    """`call` without the copies, for an answer that changes its arguments in place by design (an
    optimizer step, gradients unscaled in place, hooks registered on a module): the check reads
    the changes back from the objects it passed. Those must be the answer's own, made for this
    call: never what the check computes its expectation from (a @harness builds them from the
    seed; the check computes its expectation from objects of its own, before the call). Under the
    grader, the changes made in the sandbox are copied back into them."""
    require_function(answer)
    return _invoke(answer, *args, **kwargs)


def _invoke(answer: Any, *args, **kwargs) -> Any:
    """Run the answer on exactly these arguments. In the grader's sandbox this is what a `Remote`
    call runs (the grading process made the copies)."""
    if isinstance(answer, Remote):
        return answer.call(args, kwargs)
    try:
        return answer(*args, **kwargs)
    except NotImplementedError as e:
        raise NotDone(f"not done yet: your function raises NotImplementedError ({e})") from None
    except Exception as e:
        raise CheckFailed(f"your function raised {type(e).__name__}: {e}",
                          hint=_hint_for_exception(e), where=learner_frames(e)) from None


def _copied(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Deep copies of a call's arguments, made with one memo, so that arguments sharing a tensor
    (a model and its optimizer, two views of one storage) share its copy. A view keeps its offset
    into a copy of its whole storage; a parameter keeps its .grad (which `Parameter.__deepcopy__`
    drops); a tensor inside a graph becomes `clone()`, a copy that gradients still flow through.
    Functions, numbers and strings are their own copies."""
    memo: dict = {}
    for t in _graph_tensors((args, kwargs)):
        memo[id(t)] = t.clone()
    try:
        copies = copy.deepcopy((args, kwargs), memo)
    except Exception as e:
        raise GraderError(f"the check cannot copy an argument for the answer ({type(e).__name__}: "
                          f"{e}): pass what copy.deepcopy copies, or make the objects for the "
                          "answer and use call_inplace") from None
    for original in list(memo.get(id(memo), [])):
        if isinstance(original, torch.nn.Parameter) and original.grad is not None:
            memo[id(original)].grad = copy.deepcopy(original.grad, memo)
    return copies


def _graph_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors in a graph (not leaves: deepcopy refuses them), inside tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            yield value
    elif depth < 4 and isinstance(value, (tuple, list)):
        for v in value:
            yield from _graph_tensors(v, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            yield from _graph_tensors(v, depth + 1)


_LIBRARIES = tuple(str(pathlib.Path(p).resolve()) for p in {
    *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    pathlib.Path(__file__).resolve().parent.parent})


def learner_frames(error: BaseException, *, limit: int = 3) -> list[str]:
    """Where in the learner's own code `error` happened: the last `limit` frames that are not in
    the companion, PyTorch or the standard library, two lines each (place, then the source line).
    Notebook cells are named as IPython names them ("Cell In[5], line 3")."""
    shown = []
    for frame in traceback.extract_tb(error.__traceback__):
        path = str(pathlib.Path(frame.filename).resolve())
        if path.startswith(_LIBRARIES) or frame.filename.startswith("<frozen"):
            continue
        shown.append(f"  in your code: {_place(frame.filename, frame.lineno)}, in {frame.name}")
        if frame.line:
            shown.append(f"      {frame.line.strip()}")
    return shown[-2 * limit:]


def _place(filename: str, lineno: int | None) -> str:
    """"Cell In[5], line 3" for a notebook cell, "module.py, line 3" for a file."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    named = shell.compile.format_code_name(filename) if shell is not None else None
    label = f"{named[0]} {named[1]}" if named else pathlib.Path(filename).name
    return f"{label}, line {lineno}"


def _hint_for_exception(e: Exception) -> str:
    text = str(e)
    if "shape" in text or "size" in text or "dimension" in text:
        return "check the shapes: print x.shape for each tensor you combine."
    if "dtype" in text or "expected scalar type" in text:
        return "check the dtypes: tensors you combine must share one (see x.dtype)."
    if "does not require grad" in text or "grad_fn" in text:
        return "autograd needs requires_grad=True on the tensors you differentiate."
    return "run your function by hand on a small input to see where it fails."


_SEED_SOURCE: list[random.Random] = []     # innermost `seeded` block last; empty: fresh draws


def fresh_seeds(n: int) -> list[int]:
    """n new random seeds: each call of a check draws different inputs (inside `seeded`, the
    same inputs on every run)."""
    rng = _SEED_SOURCE[-1] if _SEED_SOURCE else random.SystemRandom()
    return [rng.randrange(2**31) for _ in range(n)]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Within the block, `fresh_seeds` draws from `random.Random(seed)`: a check run twice under
    one seed draws the same inputs (the mutation benchmark runs every mutant under the same three
    seeds). Outside it, draws are fresh again."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seeded(seed): seed must be an int, got {type(seed).__name__}")
    _SEED_SOURCE.append(random.Random(seed))
    try:
        yield
    finally:
        _SEED_SOURCE.pop()


# ---------------------------------------------------------------- comparing results

def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) that fit a dtype: about a hundred ulps of its precision."""
    return {
        torch.float64: (1e-9, 0.0),
        torch.float32: (1e-4, 1e-6),
        torch.float16: (1e-2, 1e-4),
        torch.bfloat16: (2e-2, 1e-3),
    }.get(dtype, (0.0, 0.0))


def require(condition: bool, summary: str, *, hint: str = "") -> None:
    """Fail with `summary` unless `condition` holds: for behaviour, not numbers."""
    if not condition:
        raise CheckFailed(summary, hint=hint)


def compare(got: Any, expected: Any, *, name: str = "result", rtol: float | None = None,
            atol: float | None = None, hint: str = "",
            known_wrong: dict[str, Any] | None = None) -> float:
    """Check `got` against `expected` and return the largest difference.

    Tensors must match in type, shape and dtype, hold no NaN or inf where the expected does not, and
    agree within a tolerance fit for the dtype. Tuples and lists compare element by element; plain
    numbers as float64. If `got` matches a value in `known_wrong`, that entry's key is the hint.
    """
    try:
        return _compare(got, expected, name, rtol, atol)
    except CheckFailed as failure:
        wrong = [text for text, value in (known_wrong or {}).items()
                 if _matches(got, value, expected, rtol, atol)]
        failure.hint = wrong[0] if wrong else (failure.hint or hint)
        raise


def _compare(got: Any, expected: Any, name: str, rtol: float | None, atol: float | None) -> float:
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            raise CheckFailed(f"{name}: expected {len(expected)} values in a tuple, got {_short(got)}",
                              expected=expected, got=got)
        return max([_compare(g, e, f"{name}[{i}]", rtol, atol)
                    for i, (g, e) in enumerate(zip(got, expected))], default=0.0)
    got_t, exp_t = _as_tensor(got, expected, name)
    default_rtol, default_atol = _tolerance(exp_t.dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    g64, e64 = got_t.double(), exp_t.double()
    if bool(torch.isnan(g64).any()) and not bool(torch.isnan(e64).any()):
        raise CheckFailed(f"{name} contains NaN", expected=expected, got=got,
                          hint="NaN comes from 0/0, inf - inf or log of a negative; "
                               "print intermediate values to find where it starts.")
    finite = torch.isfinite(e64) & torch.isfinite(g64)
    diff = (g64 - e64).abs()
    max_diff = float(diff[finite].max()) if bool(finite.any()) else 0.0
    same_special = torch.equal(torch.isfinite(g64), torch.isfinite(e64)) and torch.equal(
        g64[~finite].nan_to_num(), e64[~finite].nan_to_num())
    if same_special and bool((diff[finite] <= atol + rtol * e64[finite].abs()).all()):
        return max_diff
    raise CheckFailed(f"{name} does not match the reference", expected=expected, got=got,
                      max_diff=max_diff if same_special else float("inf"))


def _matches(got: Any, value: Any, expected: Any, rtol: float | None, atol: float | None) -> bool:
    """Does `got` equal a known-wrong `value`, compared the way `expected` would be?"""
    try:
        _compare(got, value, "", rtol, atol)
        return True
    except (CheckFailed, TypeError, RuntimeError, ValueError):
        return False


def _as_tensor(got: Any, expected: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise CheckFailed(f"{name}: expected a tensor, got a {type(got).__name__}",
                              expected=expected, got=got)
        if got.shape != expected.shape:
            raise CheckFailed(f"{name}: expected shape {tuple(expected.shape)}, got {tuple(got.shape)}",
                              hint="a missing sum/mean, or a transpose, often changes the shape.")
        if got.dtype != expected.dtype:
            raise CheckFailed(f"{name}: expected dtype {expected.dtype}, got {got.dtype}",
                              hint="create new tensors with dtype=x.dtype, or cast with .to(x.dtype).")
        return got.detach().cpu(), expected.detach().cpu()
    if isinstance(expected, bool) or not isinstance(expected, (int, float)):
        if got != expected:
            raise CheckFailed(f"{name}: expected {expected!r}, got {_short(got)}",
                              expected=expected, got=got)
        return torch.zeros(()), torch.zeros(())
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise CheckFailed(f"{name}: expected a number, got a {type(got).__name__}: {_short(got)}",
                          expected=expected, got=got)
    return torch.tensor(float(got), dtype=torch.float64), torch.tensor(float(expected),
                                                                         dtype=torch.float64)


def _short(value: Any, limit: int = 160) -> str:
    if isinstance(value, torch.Tensor):
        body = str(value.detach().cpu()) if value.numel() <= 8 else (
            f"tensor of shape {tuple(value.shape)}, first values "
            f"{value.detach().flatten()[:4].tolist()}")
        text = f"{body} ({value.dtype})"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- the decorator and display

def exercise(*, points: int = 1, timeout: float = 5.0,
             reference: str | tuple[str, ...] = ()) -> Callable:
    """Make a function a graded check: time limit, clean failures, a pass message, a registry entry.

    The decorated function takes the learner's answer first and returns a short success message
    (what the learner achieved, e.g. the memory saved). `timeout` is seconds for the whole check;
    a learner's call can pass `timeout=` to allow longer. `reference` names the companion
    functions or classes ("companion.gd.mse_gradient") that an answer to this exercise must not
    call: the grader scores an answer that does 0.
    """
    def wrap(check: Callable[..., str]) -> Callable[..., None]:
        name = check.__name__
        if name in REGISTRY:
            raise ValueError(f"two checks are named {name}; check names must be unique")
        refs = (reference,) if isinstance(reference, str) else tuple(reference)
        # the chapter's module: a chapter split into one module per exercise (a package) is
        # named by its package, as the notebooks import it
        module = re.sub(r"^(companion\.checks\.ch\d\d)\..*", r"\1", check.__module__)
        REGISTRY[name] = CheckInfo(name, points, timeout, module, refs, check)

        @functools.wraps(check)
        def run(answer: Any = None, *args, timeout: float = timeout, **kwargs) -> None:
            try:
                message = evaluate(name, answer, *args, timeout=timeout, **kwargs)
            except NotDone as not_done:
                _show_not_done(name, points, not_done.summary)    # no raise: Run All goes on
                return
            _show_pass(name, points, message)

        return run
    return wrap


def evaluate(name: str, answer: Any, *args, timeout: float | None = None, **kwargs) -> str:
    """Run the registered check `name` on `answer` without showing anything: return its success
    message, or raise NotDone (not written yet) or CheckFailed (with `.check` set). The grader
    calls this with a `Remote` answer; the `exercise` wrapper with the learner's own function."""
    info = REGISTRY[name]
    timeout = info.timeout if timeout is None else timeout
    import torch._dynamo  # noqa: F401  (whole, before the limit: optimizers import it on first
                          # use, and a time limit that interrupted that import would break it)
    try:
        with answer.limit(timeout) if isinstance(answer, Remote) else time_limit(timeout):
            return info.function(answer, *args, **kwargs)
    except CheckFailed as failure:                    # NotDone too: the wrapper shows it
        failure.check = name
        raise failure.with_traceback(None) from None
    except _TimeUp as stopped:
        raise CheckFailed(f"did not finish within {timeout:g} s: is there a loop that never "
                          "ends?", check=name,
                          where=stopped.where or learner_frames(stopped, limit=1),
                          hint="check the loop's stop condition; pass timeout=... to "
                               "allow longer.") from None
    except Exception as e:
        raise CheckFailed(f"could not use your answer: {type(e).__name__}: {e}", check=name,
                          hint="compare the type and shape of what you return with the "
                               "docstring.") from None


def _points(n: int) -> str:
    return f"{n} point{'s' if n != 1 else ''}"


def _show_pass(name: str, points: int, message: str) -> None:
    _show(f"✓ {name} passed ({_points(points)}): {message}", "#1a7f37",
          {"check": name, "passed": True, "points": points, "message": message})


def _show_not_done(name: str, points: int, summary: str) -> None:
    """A stub is not a wrong answer: say so, score nothing, and let the notebook run on."""
    text = (f"… {name}: not done yet ({_points(points)} once written). The cells below run "
            "without it: they use the reference.")
    _show(text, "#9a6700", {"check": name, "passed": False, "not_done": True, "points": 0,
                            "message": summary})


def _show(text: str, colour: str, record: dict) -> None:
    """Display one line of verdict: plain text and HTML for people, a MIME record for the grader."""
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        print(text)
        return
    if get_ipython() is None:
        print(text)
        return
    box = (f'<div style="color:{colour};font-family:monospace;padding:2px 0">'
           f"{html.escape(text)}</div>")
    display({"text/plain": text, "text/html": box, RESULT_MIME: record}, raw=True)
