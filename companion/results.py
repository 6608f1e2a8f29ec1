"""Recorded GPU runs that ship with the course, so a learner without a GPU still sees real numbers.

`python -m companion record` writes one file per machine, course/results/<machine>.json:

    {"machine": "NVIDIA H200", "device": "cuda", "gpus": 1, "memory_bytes": ...,
     "size_class_gb": 80, "torch": "2.x", "cuda": "12.x", "python": "3.x", "date": "2025-01-31",
     "chapters": {"04": {"experiment": "...", "date": "...", "seconds": 41.2,
                         "sizes": {"width": 4096, ...},          # the `Sizes` fields it read
                         "measured": {"mlp_step_peak_bytes": 123, "mlp_time_ratio": CURVE, ...},
                         "predicted": {"mlp_step_peak_bytes": 120, ...}}}}

A value is a number, a string, or a curve: {"x": [...], "y": [...], "xlabel": "...",
"ylabel": "..."} (also "title", "xscale", "yscale" when they matter). Notebooks call
`compare(chapter, local)` with their own figures under the same names: a table of theirs beside
each GPU's measured and predicted values, and every recorded curve drawn on the same axes as the
local one.

Example:
    >>> compare("04", {"mlp_step_peak_bytes": 4_718_592})
    No GPU run has been recorded for chapter 04 yet; the numbers above are from your device.
"""
from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from companion.memory import format_bytes

__all__ = ["RESULTS_DIR", "recorded", "compare", "table", "plot_curves", "curve", "is_curve",
           "format_value"]

RESULTS_DIR = pathlib.Path(__file__).resolve().parent.parent / "course" / "results"


def recorded(chapter: str, *, results_dir: pathlib.Path | str | None = None) -> list[dict]:
    """The recorded GPU runs that have figures for `chapter` ("01", "02", ...), one dict per
    machine: {"machine", "device", "torch", "cuda", "date", "figures"}, `figures` being the
    chapter's record (experiment, sizes, measured, predicted). Empty when none is recorded; runs
    on a CPU (the recorder's own test runs) are left out."""
    folder = pathlib.Path(results_dir) if results_dir is not None else RESULTS_DIR
    runs = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read the recorded run {path.name}: {e}. Record it again "
                             "with python -m companion record, or remove the file.") from None
        figures = record.get("chapters", {}).get(chapter)
        if figures and record.get("device") == "cuda":
            runs.append({key: record.get(key) for key in ("machine", "device", "torch", "cuda")}
                        | {"date": figures.get("date", record.get("date")), "figures": figures})
    return runs


def curve(x, y, *, xlabel: str, ylabel: str, title: str | None = None, xscale: str | None = None,
          yscale: str | None = None) -> dict:
    """A recorded curve: numbers `y` against `x` with what the axes show."""
    out = {"x": [_plain(v) for v in x], "y": [_plain(v) for v in y], "xlabel": xlabel,
           "ylabel": ylabel}
    for key, value in (("title", title), ("xscale", xscale), ("yscale", yscale)):
        if value is not None:
            out[key] = value
    return out


def _plain(v: Any) -> Any:
    """A JSON number from a Python or 0-d tensor number."""
    return v.item() if hasattr(v, "item") else v


def is_curve(value: Any) -> bool:
    """True for a recorded curve: a dict with "x" and "y" lists of the same length."""
    return (isinstance(value, dict) and isinstance(value.get("x"), list)
            and isinstance(value.get("y"), list) and len(value["x"]) == len(value["y"]))


def format_value(name: str, value: Any) -> str:
    """A value for the table: bytes by their unit (names ending in _bytes), seconds in ms, other
    numbers to 4 significant digits, "—" when missing."""
    if value is None:
        return "—"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return str(value)
    if name.endswith("_bytes"):
        return format_bytes(value)
    if name.endswith("_seconds"):
        return f"{value * 1e3:.2f} ms"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def table(local: dict[str, Any] | None, runs: list[dict]) -> str:
    """Rows of every scalar in `local` or in the runs' measured values: yours, then each run's
    measured and predicted value. Curves are left to `plot_curves`."""
    local = local or {}
    names = [n for n in local if not is_curve(local[n])]
    for run in runs:
        names += [n for n, v in run["figures"].get("measured", {}).items()
                  if not is_curve(v) and n not in names]
    header = ["", "yours"] + [col for run in runs
                              for col in (f"{run['machine']}", "predicted")]
    rows = [header]
    for name in names:
        row = [name.replace("_", " "), format_value(name, local.get(name))]
        for run in runs:
            figures = run["figures"]
            row += [format_value(name, figures.get("measured", {}).get(name)),
                    format_value(name, figures.get("predicted", {}).get(name))]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    return "\n".join(lines)


def plot_curves(local: dict[str, Any] | None, runs: list[dict], *, local_label: str = "yours"):
    """One panel per curve recorded in `runs` (and in `local`): yours, each GPU's measured curve
    and, dashed, its predicted one, on the same axes. Returns the figure, or None without curves."""
    import matplotlib.pyplot as plt

    local = local or {}
    names = [n for n, v in local.items() if is_curve(v)]
    for run in runs:
        names += [n for n, v in run["figures"].get("measured", {}).items()
                  if is_curve(v) and n not in names]
    if not names:
        return None
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names):
        drawn = []                                    # the curves, whose labels name the axes
        if is_curve(local.get(name)):
            _draw(ax, local[name], "o-", f"{local_label} (measured)")
            drawn.append(local[name])
        for i, run in enumerate(runs):
            measured = run["figures"].get("measured", {}).get(name)
            predicted = run["figures"].get("predicted", {}).get(name)
            if is_curve(measured):
                _draw(ax, measured, "s-", f"{run['machine']} (measured)", color=f"C{i + 1}")
                drawn.append(measured)
            if is_curve(predicted):
                _draw(ax, predicted, "--", f"{run['machine']} (predicted)", color=f"C{i + 1}")
        style = {}
        for c in reversed(drawn):
            style.update({k: v for k, v in c.items() if k not in ("x", "y")})
        ax.set(xlabel=style.get("xlabel", "x"), ylabel=style.get("ylabel", name.replace("_", " ")),
               title=style.get("title", name.replace("_", " ")))
        ax.set_xscale(style.get("xscale", "linear"))
        ax.set_yscale(style.get("yscale", "linear"))
        _ticks(ax, drawn, log=style.get("xscale") == "log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _ticks(ax, drawn: list[dict], *, log: bool) -> None:
    """x ticks at the measured points when they are few whole numbers or on a log axis; a y axis
    whose values are all about equal is shown around them, without an offset."""
    xs = sorted({x for c in drawn for x in c["x"]})
    if log or (len(xs) <= 12 and all(float(x).is_integer() for x in xs)):
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.minorticks_off()
    ys = [y for c in drawn for y in c["y"] if isinstance(y, (int, float)) and math.isfinite(y)]
    if ys and ax.get_yscale() == "linear":
        ax.ticklabel_format(axis="y", useOffset=False)
        middle, span = (max(ys) + min(ys)) / 2, max(ys) - min(ys)
        if span < 0.01 * max(abs(y) for y in ys):            # equal at this scale: say so
            ax.set_ylim(middle - 0.05 * abs(middle) - 1e-12, middle + 0.05 * abs(middle) + 1e-12)


def _draw(ax, curve: dict, fmt: str, label: str, **kw) -> None:
    if len(curve["x"]) > 30:                               # a long curve: a line, no markers
        fmt = fmt.strip("os")
    ax.plot(curve["x"], curve["y"], fmt, label=label, **kw)


def compare(chapter: str, local: dict[str, Any] | None = None, *,
            results_dir: pathlib.Path | str | None = None, local_label: str = "yours",
            plot: bool = True) -> None:
    """Show the recorded GPU runs of `chapter` beside `local` (your figures, under the names the
    recorder uses): which GPU, its sizes, a table, and the curves on shared axes. Says so plainly
    when no GPU run is recorded. (`recorded(chapter)` returns the runs themselves.)"""
    runs = recorded(chapter, results_dir=results_dir)
    if not runs:
        print(f"No GPU run has been recorded for chapter {chapter} yet; the numbers above are "
              "from your device.")
        return
    for run in runs:
        figures = run["figures"]
        sizes = ", ".join(f"{k} {v}" for k, v in figures.get("sizes", {}).items())
        print(f"{run['machine']} (torch {run['torch']}, CUDA {run['cuda']}, recorded "
              f"{run['date']}): {figures.get('experiment', '')}\n  GPU sizes: {sizes}")
    print()
    print(table(local, runs))
    if plot:
        fig = plot_curves(local, runs, local_label=local_label)
        if fig is not None:
            import matplotlib.pyplot as plt
            plt.show()
