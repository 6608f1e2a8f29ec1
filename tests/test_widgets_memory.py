"""companion.widgets.memory_bars: the axis unit follows the bytes drawn."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from companion.widgets import memory_bars  # noqa: E402


def test_a_small_models_states_are_drawn_in_mib_and_a_large_ones_in_gb():
    _, ax = plt.subplots()
    memory_bars({"fp32": {"parameters": 3 * 2**20, "gradients": 2**20}}, ax)
    assert ax.get_xlabel() == "MiB"
    assert max(p.get_x() + p.get_width() for p in ax.patches) == 4.0
    _, ax = plt.subplots()
    memory_bars({"7B": {"parameters": 14e9, "optimizer_state": 56e9}}, ax, limit=80e9)
    assert ax.get_xlabel().startswith("GB")
    assert max(p.get_x() + p.get_width() for p in ax.patches) == 70.0
    assert "80 GB" in ax.get_legend_handles_labels()[1]
    plt.close("all")


def test_a_limit_in_mib_is_labelled_in_mib():
    _, ax = plt.subplots()
    memory_bars({"plan": {"activations": 6 * 2**20}}, ax, limit=8 * 2**20)
    assert ax.get_xlabel() == "MiB" and "8 MiB" in ax.get_legend_handles_labels()[1]
    plt.close("all")
