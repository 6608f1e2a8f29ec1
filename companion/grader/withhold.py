"""A copy of the companion package in which one exercise's references are withheld.

An answer is graded a second time in a fresh sandbox that imports this copy (see `cleanroom`). In
it, each function an exercise withholds keeps its name and signature but its body is a single
`raise`, and each class it withholds keeps its name and bases but every method raises: the
reference's code is not in that process at all, so neither an alias made in another cell, nor a
thread, nor `exec` of `inspect.getsource(...)` can reach it. What is not part of the package
(`torch.utils.checkpoint.checkpoint`) cannot be rewritten on disk; the sandbox replaces it with a
function that raises before any learner code runs (`outside`), which the learner's code could undo:
the source scan flags the constructs that would.
"""
from __future__ import annotations

import ast
import hashlib
import importlib
import os
import pathlib

__all__ = ["MARK", "Withheld", "resolve", "locate", "withheld_sources", "write_tree", "verified_files"]

MARK = "[withheld]"          # in every message a withheld function raises


class Withheld:
    """What to rewrite: {package file: [qualname, ...]}, and the references outside the package."""

    def __init__(self):
        self.inside: dict[str, list[tuple[str, str]]] = {}     # rel path -> [(qualname, dotted)]
        self.outside: list[str] = []

    def add(self, dotted: str) -> None:
        where = locate(dotted)
        if where is None:
            self.outside.append(dotted)
        else:
            rel, qualname = where
            if (qualname, dotted) not in self.inside.setdefault(rel, []):
                self.inside[rel].append((qualname, dotted))


def resolve(dotted: str):
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def locate(dotted: str) -> tuple[str, str] | None:
    """(file relative to the package's parent, qualname) of a companion function or class; None
    for anything outside the package."""
    if not dotted.startswith("companion."):
        return None
    import companion
    obj = resolve(dotted)
    module = importlib.import_module(obj.__module__)
    root = pathlib.Path(companion.__file__).resolve().parent.parent
    path = pathlib.Path(module.__file__).resolve()
    return str(path.relative_to(root)), obj.__qualname__


def _raise(dotted: str) -> ast.stmt:
    message = f"{MARK} {dotted} is withheld while this exercise is graded on its own: the " \
              "answer must not use it"
    return ast.parse(f"raise RuntimeError({message!r})").body[0]


_LIVE = "__withheld_live__"       # set at the end of a module whose own code uses a withheld name
_KEPT = ("__init__", "__new__", "__post_init__")


def _empty(fn: ast.FunctionDef | ast.AsyncFunctionDef, dotted: str) -> None:
    fn.body = [_raise(dotted)]


def _gate(fn: ast.FunctionDef | ast.AsyncFunctionDef, dotted: str) -> None:
    """Raise once the module has finished importing: its own constants were built with it."""
    check = ast.parse(f"if __import__('sys').modules[__name__].__dict__.get({_LIVE!r}):\n"
                      "    pass").body[0]
    check.body = [_raise(dotted)]
    fn.body = [check] + fn.body


def _class(node: ast.ClassDef, dotted: str, gated: bool) -> None:
    """Every method raises; a dunder other than __call__ is kept (hashing, printing), and so is
    the constructor, gated when the package builds instances of the class as it imports."""
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if item.name in _KEPT:
                (_gate if gated else _empty)(item, f"{dotted}.{item.name}")
            elif not (item.name.startswith("__") and item.name != "__call__"):
                _empty(item, f"{dotted}.{item.name}")
        elif isinstance(item, ast.ClassDef):
            _class(item, f"{dotted}.{item.name}", gated)


def _module_level_names(tree: ast.Module) -> set[str]:
    """Names a module uses while it imports (not inside function bodies)."""
    found, stack = set(), list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack += getattr(node, "decorator_list", []) + node.args.defaults
            continue
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        stack += list(ast.iter_child_nodes(node))
    return found


def _find(body: list[ast.stmt], path: list[str]):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                node.name == path[0]:
            if len(path) == 1:
                return node
            if isinstance(node, ast.ClassDef):
                return _find(node.body, path[1:])
    return None


def withheld_sources(files: dict[str, bytes], withheld: Withheld) -> dict[str, bytes]:
    """The package's files with the withheld definitions emptied (ValueError if one is missing).
    A function keeps only its `raise`; a class, see `_class`."""
    out = dict(files)
    for rel, names in withheld.inside.items():
        tree = ast.parse(files[rel].decode())
        used = _module_level_names(tree)
        live = False
        for qualname, dotted in names:
            node = _find(tree.body, qualname.split("."))
            if node is None:
                raise ValueError(f"{dotted}: no definition {qualname} in {rel}")
            gated = node.name in used
            live |= gated
            if isinstance(node, ast.ClassDef):
                _class(node, dotted, gated)
            elif gated:
                _gate(node, dotted)
            else:
                _empty(node, dotted)
        if live:
            tree.body.append(ast.parse(f"{_LIVE} = True").body[0])
        out[rel] = (ast.unparse(ast.fix_missing_locations(tree)) + "\n").encode()
    return out


def write_tree(files: dict[str, bytes], root: pathlib.Path) -> pathlib.Path:
    """Write files under root, readable by every user and writable by none but the owner."""
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    for rel, data in files.items():
        path = root / rel
        for parent in reversed(path.relative_to(root).parents[:-1]):
            folder = root / parent
            if not folder.is_dir():
                folder.mkdir()
                os.chmod(folder, 0o755)
        path.write_bytes(data)
        os.chmod(path, 0o644)
    return root


def verified_files(root: pathlib.Path, digests: dict[str, str]) -> dict[str, bytes]:
    """The files under root named in `digests` (path -> SHA-256), each checked; ValueError names
    the first that differs, is missing, or has appeared."""
    out = {}
    for rel, digest in digests.items():
        path = root / rel
        try:
            data = path.read_bytes()
        except OSError:
            raise ValueError(f"{rel} is missing from the grader's copy") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{rel} was changed in the grader's copy")
        out[rel] = data
    return out
