"""Memory by kind as stacked bars, and a calculator over `companion.estimate` (chapter 00's widgets)."""
from __future__ import annotations

__all__ = ["memory_bars", "memory_calculator"]


def memory_bars(rows: dict, ax=None, *, limit: float | None = None, title: str = ""):
    """Horizontal stacked bars of bytes by kind, one bar per row: {label: {kind: bytes}}.

    `limit` (bytes) draws a dashed line, e.g. a GPU's memory. The axis is in GB (10⁹ bytes), or in
    MiB when the largest bar is under 0.1 GB (a small model's states). Returns the Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 + 0.45 * len(rows)))
    colours = {"parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer_state": "#2ca02c",
               "activations": "#d62728", "temporaries": "#9467bd"}
    largest = max([sum(r.get(k, 0) for k in colours) for r in rows.values()] + [limit or 0])
    scale, unit = (1e9, "GB per device (10⁹ bytes)") if largest >= 1e8 else (2**20, "MiB")
    labels = list(rows)[::-1]
    left = [0.0] * len(labels)
    for kind, colour in colours.items():
        widths = [rows[label].get(kind, 0) / scale for label in labels]
        if any(widths):
            ax.barh(labels, widths, left=left, color=colour, label=kind.replace("_", " "))
            left = [a + b for a, b in zip(left, widths)]
    if limit is not None:
        shown = f"{limit / 1e9:g} GB" if scale == 1e9 else f"{limit / 2**20:g} MiB"
        ax.axvline(limit / scale, color="k", ls="--", lw=1, label=shown)
    ax.set(xlabel=unit, title=title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")   # beside the bars
    return ax


def memory_calculator(n_params: float = 1.5e9, *, batch: int = 8, seq_len: int = 1024,
                      precision: str = "mixed", optimizer: str = "adam", zero_stage: int = 0,
                      world_size: int = 1, gpu_bytes: float = 80e9):
    """Training memory per device for a GPT-shaped model: sliders for parameters, batch, sequence
    length, precision, optimizer, ZeRO stage and world size over `estimate.training_memory`."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from companion import estimate

    style = {"description_width": "initial"}
    powers = [2**i for i in range(11)]
    controls = {
        "n_params": w.FloatLogSlider(value=n_params, base=10, min=6, max=12, step=0.1,
                                     description="parameters", readout_format=".3g", style=style),
        "batch": w.SelectionSlider(options=powers[:10], value=batch, description="batch / device",
                                   style=style),
        "seq_len": w.SelectionSlider(options=[2**i for i in range(7, 16)], value=seq_len,
                                     description="sequence length", style=style),
        "precision": w.Dropdown(options=estimate.PRECISIONS, value=precision,
                                description="precision", style=style),
        "optimizer": w.Dropdown(options=estimate.OPTIMIZERS, value=optimizer,
                                description="optimizer", style=style),
        "zero_stage": w.Dropdown(options=[0, 1, 2, 3], value=zero_stage, description="ZeRO stage",
                                 style=style),
        "world_size": w.SelectionSlider(options=powers, value=world_size, description="GPUs",
                                        style=style),
    }
    summary, plot = w.HTML(), w.Output()

    def redraw(change=None):
        v = {name: c.value for name, c in controls.items()}
        n = int(v.pop("n_params"))
        shape = estimate.gpt_shape(n, seq_len=v["seq_len"])
        parts = estimate.training_memory(n, shape=shape, **v)
        total = sum(parts.values())
        fits = "fits" if total <= gpu_bytes else "does NOT fit"
        summary.value = (f"<code>GPT of {n:.3g} parameters (width {shape['width']}, depth "
                         f"{shape['depth']}): {total / 1e9:.1f} GB per device, {fits} in "
                         f"{gpu_bytes / 1e9:g} GB</code>")
        with plot:
            plot.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 1.8))
            memory_bars({"predicted": parts}, ax, limit=gpu_bytes,
                        title="Predicted training memory per device, by kind")
            fig.tight_layout()
            display(fig)
            plt.close(fig)

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    boxes = list(controls.values())
    return w.VBox([w.HBox(boxes[:3]), w.HBox(boxes[3:]), summary, plot])
