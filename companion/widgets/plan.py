"""The plan explorer: a budget slider, the plan the planner chooses for it, and its memory bars
(chapter 09's widget)."""
from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["budget_view", "draw_plan_bars", "plan_explorer"]

_COLOURS = {"parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer_state": "#2ca02c",
            "activations": "#d62728", "temporaries": "#9467bd", "host": "#bbbbbb"}


def budget_view(model_fn: Callable, batch: int, budget: int, **options) -> dict:
    """What the explorer shows for one budget: the fastest plan predicted to fit (no simulation,
    so that moving the slider is instant), its predicted bytes by kind beside the plain run's,
    and a one-line summary; or, when nothing fits, the reason. `options` go to `plan`.

    Returns {"summary": str, "bars": {label: {kind: bytes}}, "budget": int, "fits": bool}."""
    from companion.memory import format_bytes
    from companion.plan import NothingFits, plan

    try:
        p = plan(model_fn, batch, budget=budget, verify=0, **options)
    except NothingFits as nothing:
        return {"summary": f"nothing fits: {nothing}", "bars": {}, "budget": budget,
                "fits": False}
    row = p.chosen_row
    bars = {"plain run": p.plain.predicted.kinds(), "chosen plan": row.predicted.kinds()}
    if row.predicted.host:
        bars["chosen plan, host"] = {"host": row.predicted.host}
    summary = (f"{format_bytes(budget)}: {p.chosen.describe()}; predicted peak "
               f"{format_bytes(row.predicted.peak)} (plain run "
               f"{format_bytes(p.plain.predicted.peak)}), about "
               f"{row.seconds['total'] * 1e3:.0f} ms per step by the cost model")
    return {"summary": summary, "bars": bars, "budget": budget, "fits": True}


def draw_plan_bars(view: dict, ax=None):
    """Stacked horizontal bars of `budget_view(...)["bars"]`, in MiB, with the budget dashed."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.4))
    rows = view["bars"]
    labels = list(rows)[::-1]
    left = [0.0] * len(labels)
    for kind, colour in _COLOURS.items():
        widths = [rows[label].get(kind, 0) / 2**20 for label in labels]
        if any(widths):
            ax.barh(labels, widths, left=left, color=colour, label=kind.replace("_", " "))
            left = [a + b for a, b in zip(left, widths)]
    ax.axvline(view["budget"] / 2**20, color="k", ls="--", lw=1, label="device budget")
    ax.set(xlabel="MiB (predicted)", title="Predicted peak memory by kind: plain run and plan")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return ax


def plan_explorer(model_fn: Callable, batch: int, budgets: Iterable[int], *,
                  budget: int | None = None, **options):
    """A slider over `budgets` (bytes); for each, the planner's choice and its memory bars.
    `options` go to `companion.plan.plan` (device, world_size, allow, ...)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from companion.memory import format_bytes

    budgets = sorted(budgets)
    slider = w.SelectionSlider(options=[(format_bytes(b), b) for b in budgets],
                               value=budget if budget in budgets else budgets[len(budgets) // 2],
                               description="device budget", continuous_update=False,
                               style={"description_width": "initial"},
                               layout=w.Layout(width="520px"))
    summary, plot = w.HTML(), w.Output()

    def redraw(change=None):
        view = budget_view(model_fn, batch, slider.value, **options)
        summary.value = f"<code>{view['summary']}</code>"
        with plot:
            plot.clear_output(wait=True)
            if view["fits"]:
                fig, ax = plt.subplots(figsize=(8, 2.4))
                draw_plan_bars(view, ax)
                fig.tight_layout()
                display(fig)
                plt.close(fig)

    slider.observe(redraw, names="value")
    redraw()
    return w.VBox([slider, summary, plot])
