"""Checks for chapter 11, fewer bits (a package: its modules split out in the next commit)."""
from companion.checks.ch11.layout_choice import *  # noqa: F401,F403
from companion.checks.ch11.layout_choice import __all__  # noqa: F401
