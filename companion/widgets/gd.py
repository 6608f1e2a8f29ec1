"""Gradient descent explorer: learning rate and batch size against the loss curve (chapter 01's widget)."""
from __future__ import annotations

__all__ = ["gd_explorer"]


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
