"""Interactive explorers for the notebooks (ipywidgets).

Each builder only wires widgets to a plain function that lives in the concept's module and is
tested in pytest; a builder returns the widget so a notebook cell displays it by ending with it.
"""
from __future__ import annotations

__all__ = ["gd_explorer", "float_explorer", "memory_bars", "memory_calculator"]


def gd_explorer(X, y, *, epochs: int = 10, lr: float = 0.05, batch_size: int = 32):
    """Sliders for learning rate and batch size over `companion.gd.explore`, with the loss curve."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from companion import gd

    lr_slider = w.FloatLogSlider(value=lr, base=10, min=-3, max=0.5, step=0.05,
                                 description="learning rate", readout_format=".3g",
                                 style={"description_width": "initial"})
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= X.shape[0]]
    batch_slider = w.SelectionSlider(options=sizes, value=min(sizes, key=lambda b: abs(b - batch_size)),
                                     description="batch size", style={"description_width": "initial"})
    summary, plot = w.HTML(), w.Output()

    def redraw(change=None):
        view = gd.explore(X, y, lr=lr_slider.value, batch_size=batch_slider.value, epochs=epochs)
        summary.value = f"<code>{view['summary']}</code>"
        with plot:
            plot.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(6, 3.2))
            ax.plot(view["examples_seen"], view["step_loss"], lw=1)
            ax.set(yscale="log", xlabel="examples seen", ylabel="batch MSE (log scale)",
                   title=f"Mini-batch SGD: lr={lr_slider.value:.3g}, batch={batch_slider.value}")
            fig.tight_layout()
            display(fig)
            plt.close(fig)

    lr_slider.observe(redraw, names="value")
    batch_slider.observe(redraw, names="value")
    redraw()
    return w.VBox([w.HBox([lr_slider, batch_slider]), summary, plot])


def float_explorer(value: float = 0.1, fmt: str = "bf16"):
    """Toggle the bits of a float, or type a value, over `companion.floats`.

    One button per bit (sign red, exponent orange, mantissa blue). Clicking one flips it with
    `floats.flip_bit`; the fields and their meaning come from `floats.fields_of_bits`, and the table
    from `floats.rounding_report`: what every format stores for the value, and its rounding error.
    """
    import html

    import ipywidgets as w

    from companion import floats

    style = {"description_width": "initial"}
    picker = w.Dropdown(options=list(floats.FORMATS), value=fmt, description="format", style=style)
    typed = w.Text(value=repr(float(value)), description="value", continuous_update=False,
                   style=style, layout=w.Layout(width="260px"))
    buttons, fields_view, table = w.HBox(), w.HTML(), w.HTML()
    colour = {"sign": "danger", "exponent": "warning", "mantissa": "info"}
    state = {"bits": floats.encode(value, fmt), "x": float(value), "clicked": False}

    def show() -> None:
        name = picker.value
        f = floats.FORMATS[name]
        roles = floats.bit_roles(name)
        row = []
        for i, role in enumerate(roles):
            position = f.bits - 1 - i
            b = w.Button(description=str(state["bits"] >> position & 1), button_style=colour[role],
                         tooltip=f"{role} bit (position {position})",
                         layout=w.Layout(width="30px", padding="0"))
            b.on_click(lambda _, p=position: flip(p))
            row.append(b)
        buttons.children = row
        fields_view.value = f"<pre>{html.escape(str(floats.fields_of_bits(state['bits'], name)))}</pre>"
        head = "".join(f"<th>{h}</th>" for h in ("format", "bits", "stored", "error", "rel. error", ""))
        body = "".join(
            f"<tr><td>{r['format']}</td><td><code>{r['bits']}</code></td><td>{r['value']!r}</td>"
            f"<td>{r['error']:.3g}</td><td>{r['relative_error']:.3g}</td><td>{r['note']}</td></tr>"
            for r in floats.rounding_report(state["x"]))
        table.value = (f"<p>{html.escape(repr(state['x']))} stored in each format:</p>"
                       f"<table><tr>{head}</tr>{body}</table>")

    def flip(position: int) -> None:
        state["bits"] = floats.flip_bit(state["bits"], position, picker.value)
        state["x"] = floats.decode(state["bits"], picker.value)
        state["clicked"] = True             # show the value without re-encoding it (NaN payloads)
        typed.value = repr(state["x"])
        state["clicked"] = False
        show()

    def on_typed(change) -> None:
        if state["clicked"]:
            return
        try:
            state["x"] = float(change["new"])
        except ValueError:
            fields_view.value = "<pre>type a number, e.g. 0.1, 1e-8, 65504, inf or nan</pre>"
            return
        state["bits"] = floats.encode(state["x"], picker.value)
        show()

    def on_format(change) -> None:
        state["bits"] = floats.encode(state["x"], change["new"])
        show()

    typed.observe(on_typed, names="value")
    picker.observe(on_format, names="value")
    show()
    return w.VBox([w.HBox([picker, typed]), buttons, fields_view, table])


def memory_bars(rows: dict, ax=None, *, limit: float | None = None, title: str = ""):
    """Horizontal stacked bars of bytes by kind, one bar per row: {label: {kind: bytes}}.

    `limit` (bytes) draws a dashed line, e.g. a GPU's memory. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 + 0.45 * len(rows)))
    colours = {"parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer_state": "#2ca02c",
               "activations": "#d62728", "temporaries": "#9467bd"}
    labels = list(rows)[::-1]
    left = [0.0] * len(labels)
    for kind, colour in colours.items():
        widths = [rows[label].get(kind, 0) / 1e9 for label in labels]
        if any(widths):
            ax.barh(labels, widths, left=left, color=colour, label=kind.replace("_", " "))
            left = [a + b for a, b in zip(left, widths)]
    if limit is not None:
        ax.axvline(limit / 1e9, color="k", ls="--", lw=1, label=f"{limit / 1e9:g} GB")
    ax.set(xlabel="GB per device (10⁹ bytes)", title=title)
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
