"""What travels between the grader and a learner's sandbox, and how the grader reads it safely.

Grader -> sandbox: requests, pickled (the sandbox trusts the grader). Sandbox -> grader: replies
written with `torch.save` and read with `torch.load(weights_only=True)`, which builds tensors and
plain containers only and never runs code; the grader then accepts nothing but plain data (`plain`).
Each message is a 4-byte length and a body of at most `MAX_BYTES`.
"""
from __future__ import annotations

import io
import os
import pickle
import struct
from typing import Any

import torch

__all__ = ["MAX_BYTES", "Opaque", "WireError", "frame", "send", "receive", "encode", "dumps",
           "decode", "plain", "AnswerPickler", "answer_unpickler"]

MAX_BYTES = 512 * 2**20
_OPAQUE = "\x00opaque"
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class WireError(Exception):
    """A reply the grader will not accept: malformed, too large, or not plain data."""


class Opaque:
    """Stands in for an object the learner returned that is not plain data: its class is named
    after the learner's type and its repr is the learner's, so messages read as in a notebook."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


_OPAQUE_CLASSES: dict[str, type] = {}


def _opaque_class(type_name: str) -> type:
    name = "".join(c for c in type_name if c.isalnum() or c == "_")[:60] or "object"
    if name not in _OPAQUE_CLASSES:
        _OPAQUE_CLASSES[name] = type(name, (Opaque,), {"__module__": "learner"})
    return _OPAQUE_CLASSES[name]


# ---------------------------------------------------------------- framing

def frame(body: bytes) -> bytes:
    """The message as it travels: its length in 4 bytes, then the body."""
    return struct.pack("!I", len(body)) + body


def send(fd: int, body: bytes) -> None:
    data = frame(body)
    while data:
        data = data[os.write(fd, data):]


def _read(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive(fd: int) -> bytes:
    (n,) = struct.unpack("!I", _read(fd, 4))
    if n > MAX_BYTES:
        raise WireError(f"a message of {n} bytes (the limit is {MAX_BYTES})")
    return _read(fd, n)


# ---------------------------------------------------------------- the sandbox's side

def encode(value: Any, depth: int = 0) -> Any:
    """`value` as plain data for torch.save: plain tensors (detached, on the CPU), numbers,
    strings, None, and tuples/lists/dicts of them; anything else becomes an opaque stand-in."""
    if depth > 20:
        return {_OPAQUE: "deep", "repr": "a structure nested more than 20 levels"}
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
        grad = value.requires_grad and value.is_leaf
        return value.detach().cpu().clone().requires_grad_(grad)
    if isinstance(value, torch.Tensor):
        return _opaque(value, f"a torch.Tensor subclass ({type(value).__name__}): return a plain "
                              "tensor")
    if type(value) in _SCALARS:
        return value
    for kind in (bool, int, float):                     # numpy's float64, IntEnum: the value
        if isinstance(value, kind):
            return kind(value)
    if type(value) in (tuple, list):
        return type(value)(encode(v, depth + 1) for v in value)
    if type(value) is torch.Size:
        return tuple(value)
    if type(value) is dict and all(type(k) in (str, int) for k in value):
        return {k: encode(v, depth + 1) for k, v in value.items()}
    return _opaque(value)


def _opaque(value: Any, text: str | None = None) -> dict:
    try:
        shown = text or repr(value)
    except Exception:
        shown = f"<a {type(value).__name__}>"
    return {_OPAQUE: type(value).__name__, "repr": shown[:300]}


def dumps(reply: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(reply, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------- the grader's side

def decode(body: bytes) -> dict:
    """A reply from the sandbox, loaded without running code, checked to be plain data."""
    try:
        reply = torch.load(io.BytesIO(body), weights_only=True)
    except Exception as e:
        raise WireError(f"a reply that is not plain data ({type(e).__name__})") from None
    if type(reply) is not dict:
        raise WireError("a reply that is not a dict")
    return plain(reply)


def plain(value: Any, depth: int = 0, budget: list | None = None) -> Any:
    """Validate loaded data: exact built-in types and plain CPU tensors only; opaque stand-ins
    become `Opaque`. Raises WireError on anything else."""
    budget = [1_000_000] if budget is None else budget
    budget[0] -= 1
    if depth > 24 or budget[0] < 0:
        raise WireError("a reply nested too deep or too large")
    kind = type(value)
    if kind is torch.nn.Parameter:
        value, kind = value.detach(), torch.Tensor
    if kind is torch.Tensor:
        if value.layout != torch.strided or value.device.type != "cpu" or value.is_quantized:
            raise WireError("a tensor that is not a plain strided CPU tensor")
        return value
    if kind in _SCALARS:
        return value
    if kind in (tuple, list):
        return kind(plain(v, depth + 1, budget) for v in value)
    if kind is dict:
        if _OPAQUE in value:
            return _opaque_class(str(value[_OPAQUE]))(str(value.get("repr", ""))[:300])
        if not all(type(k) in (str, int) for k in value):
            raise WireError("a dict with keys that are not str or int")
        return {k: plain(v, depth + 1, budget) for k, v in value.items()}
    raise WireError(f"a value of type {kind.__name__}")


# ---------------------------------------------------------------- answers inside requests

class AnswerPickler(pickle.Pickler):
    """Pickles a request; a Remote (or RemoteArg) in it travels as a reference to the answer, an
    aten operator (which does not pickle) by its name."""

    def persistent_id(self, obj):
        from companion.checks.harness import Remote, RemoteArg
        if isinstance(obj, Remote):
            return ("answer", obj.name, None)
        if isinstance(obj, RemoteArg):
            return ("answer", obj.remote.name, (obj.fn.__module__, obj.fn.__qualname__))
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj._schema.name, obj._overloadname)
        return None


def answer_unpickler(body: bytes, resolve) -> Any:
    """Unpickle a request in the sandbox; resolve(name, via) gives the answer for a reference."""
    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            kind, name, via = pid
            if kind == "op":
                namespace, op = name.split("::")
                return getattr(getattr(getattr(torch.ops, namespace), op), via)
            return resolve(name, via)
    return Unpickler(io.BytesIO(body)).load()
