"""Block size against quantization error on Adam's moments (chapter 11's widget)."""
from __future__ import annotations

__all__ = ["blocksize_explorer", "plot_block_errors"]


def plot_block_errors(m, v, blocksize: int, *, ax=None):
    """log10 of v's values, and where each map puts v's smallest values at this block size:
    how many nonzero values of v each map stores as 0."""
    import matplotlib.pyplot as plt
    import torch

    from companion.lowbit import (dequantize_blockwise, dynamic_map, linear_map,
                                  quantize_blockwise)

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    logv = torch.log10(v[v > 0].float())
    ax.hist(logv.tolist(), bins=60, color="lightgray", label="v (exact)")
    for name, code, colour in (("linear map", linear_map(False), "tab:red"),
                               ("dynamic map", dynamic_map(False), "tab:blue")):
        vq = dequantize_blockwise(*quantize_blockwise(v, code, blocksize), code, blocksize)
        kept = vq[(v > 0) & (vq > 0)]
        flushed = int(((v > 0) & (vq == 0)).sum())
        ax.hist(torch.log10(kept).tolist(), bins=60, histtype="step", color=colour,
                label=f"{name}: {flushed} of {int((v > 0).sum())} stored as 0")
    ax.set(xlabel="log10 of Adam's second moment v", ylabel="values",
           title=f"v stored as 8-bit codes, blocks of {blocksize}")
    ax.legend(fontsize=8, loc="upper left")
    return ax


def blocksize_explorer(m, v, *, sizes=(64, 256, 1024, 4096, None)):
    """A slider over block sizes (None: one absmax for the whole tensor) for the moments m, v of
    one tensor: the error of Adam's direction with either map, and `plot_block_errors`."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    from IPython.display import display

    from companion.lowbit import direction_error, dynamic_map, linear_map

    whole = 1 << max(1, (m.numel() - 1).bit_length())
    options = [(str(s) if s else f"whole tensor ({m.numel()})", s or whole) for s in sizes]
    slider = w.SelectionSlider(options=options, value=options[1][1], description="block size",
                               style={"description_width": "initial"})
    table, plot = w.HTML(), w.Output()

    def redraw(change=None):
        rows = ""
        for name, signed, unsigned in (("linear", linear_map(True), linear_map(False)),
                                       ("dynamic", dynamic_map(True), dynamic_map(False))):
            e = direction_error(m, v, slider.value, signed=signed, unsigned=unsigned)
            rows += (f"<tr><td>{name}</td><td>{e['error']:.3g}</td>"
                     f"<td>{e['v_zero']:.2%}</td></tr>")
        table.value = ("<table><tr><th>map</th><th>error of m/(√v+ε), relative</th>"
                       f"<th>v stored as 0</th></tr>{rows}</table>")
        with plot:
            plot.clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(7, 3.2))
            plot_block_errors(m, v, slider.value, ax=ax)
            fig.tight_layout()
            display(fig)
            plt.close(fig)

    slider.observe(redraw, names="value")
    redraw()
    return w.VBox([slider, table, plot])
