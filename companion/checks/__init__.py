"""Exercise checks, one module per chapter (`ch01`, ...), and the grading core they share.

In a notebook: ``from companion.checks.ch01 import check_mse_gradient`` then
``check_mse_gradient(my_function)``. A pass shows a green line; a failure raises `CheckFailed`
(an AssertionError), shown as a short red message with the hint.
"""
from companion.checks.core import REGISTRY, CheckFailed, NotDone

__all__ = ["CheckFailed", "NotDone", "REGISTRY"]
