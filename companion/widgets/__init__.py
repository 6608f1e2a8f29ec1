"""Interactive explorers for the notebooks (ipywidgets), one module per concept.

Each builder only wires widgets to a plain function that lives in the concept's module and is
tested in pytest; a builder returns the widget so a notebook cell displays it by ending with it.
`from companion.widgets import memory_calculator` works for every builder listed here.
"""
from companion.widgets.attention import online_softmax_explorer
from companion.widgets.floats import float_explorer
from companion.widgets.gd import gd_explorer
from companion.widgets.lowbit import blocksize_explorer
from companion.widgets.memory import memory_bars, memory_calculator
from companion.widgets.plan import plan_explorer

__all__ = ["gd_explorer", "float_explorer", "memory_bars", "memory_calculator", "plan_explorer",
           "online_softmax_explorer", "blocksize_explorer"]
