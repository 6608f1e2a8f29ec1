"""Out of Memory: the course's companion package.

Readable reference implementations of memory-saving techniques, tools that measure and predict
memory on any device, widgets, and the checks that grade the course's exercises. Import the module
you need (``from companion import gd``); this file only lists them.
"""
__all__ = [
    "checks",
    "device",
    "gd",
    "models",
]
__version__ = "0.1.0"
