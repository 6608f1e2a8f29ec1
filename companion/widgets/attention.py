"""The online softmax tile by tile (chapter 10's widget)."""
from __future__ import annotations

__all__ = ["online_softmax_explorer", "plot_tile_states"]


def plot_tile_states(scores, states, block: int, tiles_seen: int, *, ax=None):
    """One query's scores as bars, the tiles seen so far in colour, with the running maximum m
    and what the running sum l and the log-sum-exp are after `tiles_seen` tiles."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    n = scores.numel()
    seen = min(n, tiles_seen * block)
    colours = ["tab:blue" if j < seen else "lightgray" for j in range(n)]
    ax.bar(range(n), scores.tolist(), color=colours, width=0.8)
    state = states[tiles_seen - 1]
    ax.axhline(state["m"], color="tab:red", lw=1, ls="--", label=f"running max m = {state['m']:.3f}")
    for start in range(block, n, block):
        ax.axvline(start - 0.5, color="black", lw=0.5, alpha=0.4)
    ax.set(xlabel="key j", ylabel="score s_j",
           title=f"after {tiles_seen} of {len(states)} tiles: l = {state['l']:.3f}, "
                 f"m + log l = {state['lse']:.3f}")
    ax.legend(loc="lower right", fontsize=8)
    return ax


def online_softmax_explorer(scores, values, *, block: int = 8):
    """A slider over the tiles of one query's `scores` (n,) and `values` (n, d): the plot of
    `plot_tile_states` and a table of (m, l, o) against the exact softmax."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    import torch
    from IPython.display import display

    from companion.attention import tile_states

    states = tile_states(scores, values, block)
    exact_o = (scores.float().softmax(0) @ values.float()).tolist()
    exact_lse = float(torch.logsumexp(scores.float(), 0))
    slider = w.IntSlider(value=1, min=1, max=len(states), description="tiles seen",
                         style={"description_width": "initial"})
    table, plot = w.HTML(), w.Output()

    def redraw(change=None):
        state = states[slider.value - 1]
        rows = "".join(f"<tr><td>o[{i}]</td><td>{a:+.4f}</td><td>{b:+.4f}</td></tr>"
                       for i, (a, b) in enumerate(zip(state["o"][:4], exact_o[:4])))
        table.value = (f"<p>keys seen: {state['keys']} of {scores.numel()}; log-sum-exp so far "
                       f"{state['lse']:.4f}, over every key {exact_lse:.4f}</p>"
                       f"<table><tr><th></th><th>running</th><th>exact softmax</th></tr>{rows}"
                       f"</table>" + ("<p>equal: every key is in.</p>" if slider.value ==
                                      len(states) else ""))
        with plot:
            plot.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 3.2))
            plot_tile_states(scores, states, block, slider.value, ax=ax)
            fig.tight_layout()
            display(fig)
            plt.close(fig)

    slider.observe(redraw, names="value")
    redraw()
    return w.VBox([slider, plot, table])
