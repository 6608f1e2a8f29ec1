"""Mutants of a reference solution: its syntax tree rewritten one small mistake at a time.

`mutants(code, lines)` returns one `Mutant` per rewrite of a node that starts on one of `lines`
(the lines between `### BEGIN SOLUTION` and `### END SOLUTION`): the whole code again, unparsed
from the rewritten tree, with a description of the change ("line 7: compare: `a < b`: Lt -> LtE").
The rewrites are the mistakes a learner makes (the operators of mutation testing, Offutt et al.,
"An experimental determination of sufficient mutant operators", TOSEM 1996, plus this course's
own: a dtype changed, a call or a context dropped, an element of a literal tuple left out):

  compare   `<` -> `<=`, `<` -> `>=` (each comparison operator to its neighbour and its negation)
  arith     `+` <-> `-`, `*` <-> `/`, `//` -> `/`, `**` -> `*`, `%` -> `//`, `and` <-> `or`
  term      a term of a sum or difference dropped (`a + b` -> `a`, `a + b` -> `b`)
  off1      an integer constant, `range`'s bounds, an index or a slice bound one more or one less
  const     a float constant doubled (0.0 -> 1.0)
  args      two neighbouring positional arguments of a call swapped (not of max, min, transpose,
            ...: their order is no mistake); a keyword argument dropped
  elem      one element of a literal tuple, list or set of names or constants left out
  dtype     torch.float32 <-> bfloat16, float16 -> bfloat16, int32 <-> int64, ...
  early     the function's last `return` copied to the end of a loop's body (one pass only)
  call      a call statement removed (`loss.backward()`, `opt.zero_grad()`, `handle.wait()`, ...);
            a call of one argument replaced by it (`autocast(...)(fn)` -> `fn`), a method call
            without arguments by its object (`x.detach()` -> `x`)
  context   a `with` block's context dropped (`with torch.no_grad():` -> its body alone)
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import re
from typing import Callable, Iterator

__all__ = ["Mutant", "mutants", "KINDS"]

KINDS = ("compare", "arith", "term", "off1", "const", "args", "elem", "dtype", "early", "call",
         "context")

_COMPARE = {ast.Lt: (ast.LtE, ast.GtE), ast.LtE: (ast.Lt, ast.Gt), ast.Gt: (ast.GtE, ast.LtE),
            ast.GtE: (ast.Gt, ast.Lt), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,),
            ast.In: (ast.NotIn,), ast.NotIn: (ast.In,), ast.Is: (ast.IsNot,),
            ast.IsNot: (ast.Is,)}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
          ast.FloorDiv: ast.Div, ast.Pow: ast.Mult, ast.Mod: ast.FloorDiv}
_DTYPES = {"float32": "bfloat16", "float": "bfloat16", "bfloat16": "float32", "float16": "bfloat16",
           "half": "bfloat16", "float64": "float32", "double": "float32", "int32": "int64",
           "int64": "int32", "long": "int32", "int8": "uint8", "uint8": "int8"}


@dataclasses.dataclass(frozen=True)
class Mutant:
    kind: str          # one of KINDS
    line: int          # in the cell (1-based)
    change: str        # "`a < b`: Lt -> LtE"
    source: str        # the whole code, rewritten
    code: str = ""     # the line it changes, as written, without its comment: names the mutant
                       # in equivalent.toml (a line's number moves when a line above is edited)

    @property
    def description(self) -> str:
        return f"line {self.line}: {self.kind}: {self.change}"


def _short(node: ast.AST, limit: int = 60) -> str:
    text = ast.unparse(node).replace("\n", "; ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _offset(node: ast.expr) -> bool:
    """`-1`, `i - 1`, `n + 2`: a bound whose constant the off1 rule on constants already moves."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) or isinstance(node, ast.BinOp) and isinstance(
        node.op, (ast.Add, ast.Sub)) and isinstance(node.right, ast.Constant)


# calls whose two arguments may come in either order: swapping them is no mistake
_COMMUTATIVE = {"max", "min", "maximum", "minimum", "fmax", "fmin", "gcd", "hypot",
                "transpose", "swapaxes", "swapdims"}


def _commutative(node: ast.Call) -> bool:
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    return name in _COMMUTATIVE and len(node.args) == 2 and not node.keywords


def _plus(node: ast.expr, k: int) -> ast.expr:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return ast.Constant(node.value + k)
    return ast.BinOp(node, ast.Add() if k > 0 else ast.Sub(), ast.Constant(abs(k)))


def _rules(node: ast.AST, parents: dict) -> Iterator[tuple[str, str, Callable[[], object]]]:
    """(kind, change, apply) for each rewrite of `node` (in a private copy of the tree): apply()
    rewrites the copy and returns what goes where the node was (a list of statements, or none)."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _COMPARE.get(type(op), ()):
                def apply(i=i, new=new):
                    node.ops[i] = new()
                    return node
                yield "compare", f"{type(op).__name__} -> {new.__name__}", apply
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _ARITH:
        new = _ARITH[type(node.op)]

        def apply(new=new):
            node.op = new()
            return node
        yield "arith", f"{type(node.op).__name__} -> {new.__name__}", apply
    if isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And

        def apply(new=new):
            node.op = new()
            return node
        yield "arith", f"{type(node.op).__name__} -> {new.__name__}", apply
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        yield "term", "right term dropped", lambda: node.left
        if isinstance(node.op, ast.Add):
            yield "term", "left term dropped", lambda: node.right
    if isinstance(node, ast.Constant) and type(node.value) is int:
        for k in (1, -1):
            yield "off1", f"{node.value} -> {node.value + k}", lambda k=k: ast.Constant(
                node.value + k)
    if isinstance(node, ast.Constant) and type(node.value) is float:
        new = node.value * 2 if node.value else 1.0
        yield "const", f"{node.value!r} -> {new!r}", lambda new=new: ast.Constant(new)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        for j, arg in enumerate(node.args[:2]):
            if _offset(arg) or isinstance(arg, ast.Starred):
                continue                       # constants: off1 on the constant already
            for k in (1, -1):
                def apply(j=j, k=k):
                    node.args[j] = _plus(node.args[j], k)
                    return node
                yield "off1", f"range bound {j} {'+' if k > 0 else '-'}1", apply
    if isinstance(node, ast.Subscript) and not isinstance(node.slice, (ast.Slice, ast.Tuple)) \
            and not _offset(node.slice):
        for k in (1, -1):
            def apply(k=k):
                node.slice = _plus(node.slice, k)
                return node
            yield "off1", f"index {'+' if k > 0 else '-'}1", apply
    if isinstance(node, ast.Slice):
        for field in ("lower", "upper"):
            bound = getattr(node, field)
            if bound is None or _offset(bound):
                continue
            for k in (1, -1):
                def apply(field=field, k=k):
                    setattr(node, field, _plus(getattr(node, field), k))
                    return node
                yield "off1", f"slice {field} {'+' if k > 0 else '-'}1", apply
    if isinstance(node, ast.Call) and not _commutative(node):
        plain = [a for a in node.args if not isinstance(a, ast.Starred)]
        if len(plain) == len(node.args):
            for j in range(len(node.args) - 1):
                if ast.dump(node.args[j]) == ast.dump(node.args[j + 1]):
                    continue
                def apply(j=j):
                    node.args[j], node.args[j + 1] = node.args[j + 1], node.args[j]
                    return node
                yield "args", f"arguments {j} and {j + 1} swapped", apply
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
            node.value.id == "torch" and node.attr in _DTYPES:
        new = _DTYPES[node.attr]
        yield "dtype", f"torch.{node.attr} -> torch.{new}", lambda new=new: ast.Attribute(
            ast.Name("torch", ast.Load()), new, ast.Load())
    if isinstance(node, ast.Call) and not node.keywords and len(node.args) == 1 and \
            not isinstance(node.args[0], ast.Starred):
        yield "call", "call dropped, its argument kept", lambda: node.args[0]
    if isinstance(node, ast.Call) and not node.args and not node.keywords and \
            isinstance(node.func, ast.Attribute):
        yield "call", f"`.{node.func.attr}()` dropped", lambda: node.func.value
    if isinstance(node, ast.Call):
        for j, keyword in enumerate(node.keywords):
            if keyword.arg is None:
                continue
            def apply(j=j):
                del node.keywords[j]
                return node
            yield "args", f"`{keyword.arg}=` dropped", apply
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) >= 2 and all(
            isinstance(e, (ast.Constant, ast.Attribute)) for e in node.elts):
        for j, element in enumerate(node.elts):
            def apply(j=j):
                del node.elts[j]
                return node
            yield "elem", f"`{_short(element)}` left out", apply
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield "call", "call removed", lambda: ast.Pass()
    if isinstance(node, (ast.With, ast.AsyncWith)) and len(node.items) == 1 and \
            node.items[0].optional_vars is None:
        yield "context", f"`with {_short(node.items[0].context_expr)}` dropped", \
            lambda: node.body
    if isinstance(node, (ast.For, ast.While)):
        function = parents.get("function_of", {}).get(id(node))
        returns = [n for n in ast.walk(function) if isinstance(n, ast.Return)] if function else []
        if function is not None:
            last = returns[-1] if returns else ast.Return(None)

            def apply(last=last):
                node.body.append(copy.deepcopy(last))
                return node
            yield "early", f"`{_short(last)}` at the end of the loop's first pass", apply


def _functions(tree: ast.AST) -> dict[int, ast.AST]:
    """id(loop) -> the innermost function it is in."""
    out = {}
    for function in ast.walk(tree):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if isinstance(node, (ast.For, ast.While)):
                    out[id(node)] = function    # walk order: inner functions come later, win
    return out


def _replace(parent: ast.AST, old: ast.AST, new) -> None:
    for field, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, field, new)
            return
        if isinstance(value, list) and any(v is old for v in value):
            i = next(i for i, v in enumerate(value) if v is old)
            value[i:i + 1] = new if isinstance(new, list) else [new]
            return
    raise AssertionError("node not found in its parent")


def mutants(code: str, lines: set[int]) -> list[Mutant]:
    """Every mutant of `code` (Python source) that rewrites a node starting on one of `lines`,
    each once (two rewrites that give the same code are one mutant), in the order of the source."""
    tree = ast.parse(code)
    original, written = ast.unparse(tree), code.splitlines()
    count = sum(1 for _ in ast.walk(tree))
    seen, out = {original}, []
    for index in range(count):
        probe = ast.parse(code)
        node = list(ast.walk(probe))[index]
        if getattr(node, "lineno", None) not in lines:
            continue
        n_rules = sum(1 for _ in _rules(node, {"function_of": _functions(probe)}))
        for r in range(n_rules):
            work = ast.parse(code)
            nodes = list(ast.walk(work))
            target = nodes[index]
            parents = {id(c): p for p in nodes for c in ast.iter_child_nodes(p)}
            parents["function_of"] = _functions(work)
            kind, change, apply = list(_rules(target, parents))[r]
            before = _short(target)
            new = apply()
            if new is not target:
                _replace(parents[id(target)], target, new)
            ast.fix_missing_locations(work)
            try:
                source = ast.unparse(work)
                compile(source, "<mutant>", "exec")
            except (SyntaxError, ValueError):
                continue
            if source in seen:
                continue
            seen.add(source)
            if kind not in ("early", "context"):
                change = f"`{before}`: {change}"
            line = re.sub(r"\s{2,}#.*$", "", written[target.lineno - 1]).strip()  # no comment
            out.append(Mutant(kind, target.lineno, change, source, line))
    out.sort(key=lambda m: (m.line, KINDS.index(m.kind)))
    return _numbered(out)


def _numbered(found: list[Mutant]) -> list[Mutant]:
    """Two mutants described alike (the same constant twice on a line): the second and later say
    which occurrence they are, so a description names one mutant."""
    seen: dict[str, int] = {}
    out = []
    for m in found:
        seen[m.description] = seen.get(m.description, 0) + 1
        n = seen[m.description]
        out.append(m if n == 1 else dataclasses.replace(m, change=f"{m.change} (occurrence {n})"))
    return out
