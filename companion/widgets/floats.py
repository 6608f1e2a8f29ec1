"""A bit explorer for the float formats of `companion.floats` (chapter 02's widget)."""
from __future__ import annotations

__all__ = ["float_explorer"]


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
