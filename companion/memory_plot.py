"""Draw what `companion.memory.track` measured: live bytes by kind over a block's allocations.

Example:
    >>> with track() as t:
    ...     model.loss(x, y).backward(); opt.step()
    >>> plot_timeline(t)                       # stacked bytes by kind, phases shaded

Kept apart from `companion.memory` so that measuring never imports matplotlib.
"""
from __future__ import annotations

from typing import Any

__all__ = ["plot_timeline"]


def plot_timeline(tracker: Any, ax=None, *, title: str = "Memory during the block"):
    """Stacked live bytes by kind over the block's allocation events, phases shaded, like PyTorch's
    memory snapshot viewer. `tracker` is a `companion.memory.MemoryTracker`. Returns the Axes."""
    import matplotlib.pyplot as plt

    data = tracker.timeline()
    kinds = [k for k in data if k not in ("event", "phase", "total")]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    scale, unit = (2**20, "MiB") if max(data["total"], default=0) >= 2**20 else (2**10, "KiB")
    ax.stackplot(data["event"], *[[v / scale for v in data[k]] for k in kinds],
                 labels=[k.replace("_", " ") for k in kinds], step="post", alpha=0.85)
    shades = {"backward": "#dddddd", "optimizer": "#f3e3c3"}
    start = 0
    for i in range(1, len(data["phase"]) + 1):
        if i == len(data["phase"]) or data["phase"][i] != data["phase"][start]:
            if data["phase"][start] in shades:
                ax.axvspan(start, i, color=shades[data["phase"][start]], zorder=-1, lw=0)
            start = i
    ax.set(xlabel="allocation event (white: forward, grey: backward, tan: optimizer step)",
           ylabel=f"live {unit}", title=title)
    ax.legend(loc="upper left", fontsize="small")
    return ax
