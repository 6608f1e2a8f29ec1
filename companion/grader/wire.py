"""What travels between the grader and a learner's sandbox, and how the grader reads it safely.

Grader -> sandbox: requests, pickled (the sandbox trusts the grader). Sandbox -> grader: replies
written with `torch.save` and read with `torch.load(weights_only=True)`, which builds tensors and
plain containers only and never runs code; the grader then accepts nothing but plain data (`plain`).
Each message is a 4-byte length and a body of at most `MAX_BYTES`.

The sandbox's side can be anything (its code is the learner's to patch), so `decode` bounds what
a reply costs the grading process before torch builds it (`_bounded`): the body must be a zip of
stored entries, as torch.save writes it (a deflated entry expands up to 1,032 times: zlib's
technical details, zlib.net/zlib_tech.html; torch.load reads them, and the legacy format, too),
whose sizes add up to no more than the body (entries that share bytes would not); its pickle's
opcodes are costed one by one (the objects each builds, their slots in containers and in the
memo). The tensors it builds, views included, may span no more bytes than the limit (a stride-0
view of one float may claim gigabytes, which a check builds as soon as it computes with it). A
reply over `decoded_limit` is refused without being built.
"""
from __future__ import annotations

import io
import os
import pickle
import pickletools
import struct
import zipfile
from typing import Any

import torch

__all__ = ["MAX_BYTES", "decoded_limit", "Opaque", "WireError", "frame", "send", "receive",
           "encode", "dumps", "decode", "plain", "AnswerPickler", "answer_unpickler"]

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
    if type(value) is dict and all(_plain_key(k) for k in value):
        return {k: encode(v, depth + 1) for k, v in value.items()}
    return _opaque(value)


def _plain_key(key: Any, depth: int = 0) -> bool:
    """A dict key that is plain data: a str or an int, or a short tuple of them (chapter 08's
    schedule is keyed by (stage, group))."""
    if type(key) in (str, int):
        return True
    return type(key) is tuple and depth < 3 and len(key) <= 16 and \
        all(_plain_key(k, depth + 1) for k in key)


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

def decoded_limit(size: int) -> int:
    """The most bytes `decode` may build from a reply of `size` bytes: its tensors' data as sent
    (once), the Python objects around them (a float takes 9 bytes in a pickle and 24 in memory
    plus a slot where it is kept), and room for small replies."""
    return 4 * size + 16 * 2**20


# What each pickle opcode may cost the grading process, in bytes (sys.getsizeof on CPython 3.11:
# {} 64, [] 56, set() 216, () 40, float 24, int 28; a slot where an object is kept, in a list
# (8), a dict (~37 an item at 1,000 items) or the memo, is counted as 40). A tensor (or an
# OrderedDict) built by REDUCE costs 1 KiB: 315 bytes measured a tensor view (RSS over 200,000).
_SLOT, _TENSOR = 40, 1024
_COSTS = {"NONE": _SLOT, "NEWTRUE": _SLOT, "NEWFALSE": _SLOT, "BININT": _SLOT + 32,
          "BININT1": _SLOT + 32, "BININT2": _SLOT + 32, "BINFLOAT": _SLOT + 24,
          "EMPTY_DICT": _SLOT + 64, "EMPTY_LIST": _SLOT + 56, "EMPTY_SET": _SLOT + 216,
          "EMPTY_TUPLE": _SLOT + 40, "TUPLE": _SLOT + 40, "TUPLE1": _SLOT + 48,
          "TUPLE2": _SLOT + 56, "TUPLE3": _SLOT + 64, "BINGET": _SLOT, "LONG_BINGET": _SLOT,
          "BINPUT": _SLOT, "LONG_BINPUT": _SLOT, "MEMOIZE": _SLOT, "GLOBAL": _SLOT,
          "REDUCE": _TENSOR, "NEWOBJ": _TENSOR, "BUILD": _TENSOR, "BINPERSID": _TENSOR,
          "MARK": _SLOT, "APPEND": 0, "APPENDS": 0, "SETITEM": 0, "SETITEMS": 0, "PROTO": 0,
          "FRAME": 0, "STOP": 0}


# Opcodes a reply's pickle may have: an honest reply of 100,000 floats has about 200,000; read at
# about 0.4 µs each, the bound keeps the reading of a crafted reply under 2 s.
_MAX_OPCODES = 2**22


def _bounded(body: bytes, limit: int) -> bytes:
    """The reply as a zip torch.load can read, rebuilt from entries checked here; WireError if it
    is not torch.save's format or would cost more than `limit` bytes to load."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(body))
        entries = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        raise WireError("a reply that is not in torch.save's format") from None
    if any(e.compress_type != zipfile.ZIP_STORED or e.file_size != e.compress_size
           or e.flag_bits & 0x1 for e in entries):
        raise WireError("a reply with compressed or encrypted parts (torch.save writes none)")
    stored = sum(e.file_size for e in entries)
    if stored > len(body):
        raise WireError(f"a reply whose parts add up to {stored} bytes in {len(body)} "
                        "(parts that overlap)")
    pickles = [e for e in entries if e.filename.endswith("/data.pkl")]
    if len(pickles) != 1:
        raise WireError("a reply that is not in torch.save's format (no single data.pkl)")
    cost, count, protos = stored, 0, 0
    try:
        for op, arg, _ in pickletools.genops(archive.read(pickles[0])):
            if op.name not in _COSTS and op.name not in ("BINUNICODE", "SHORT_BINSTRING",
                                                         "LONG1"):
                raise WireError(f"a reply with the pickle opcode {op.name}, which torch.save "
                                "does not write")
            protos += op.name == "PROTO"
            count += 1
            if protos > 1 or count > _MAX_OPCODES:      # a flood of free opcodes costs time
                raise WireError("a reply whose pickle has more than one protocol header or "
                                f"more than {_MAX_OPCODES:,} opcodes")
            cost += max(1, _COSTS.get(op.name, _SLOT + 80 + 4 * len(str(arg))))
            if cost > limit:
                break
    except (ValueError, EOFError, zipfile.BadZipFile, OSError):
        raise WireError("a reply whose pickle is malformed") from None
    if cost > limit:
        raise WireError(f"a reply of {len(body)} bytes that would take more than "
                        f"{limit / 2**20:.1f} MiB to load (the grader's limit for it)")
    rebuilt = io.BytesIO()
    with zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_STORED) as out:
        for e in entries:
            out.writestr(e.filename, archive.read(e))
    return rebuilt.getvalue()


def decode(body: bytes, limit: int | None = None) -> dict:
    """A reply from the sandbox, loaded without running code, checked to be plain data; it may
    build at most `limit` bytes (`decoded_limit(len(body))` when None), counted before it is
    loaded (`_bounded`) and, for the bytes its tensors span, before any check touches them."""
    limit = decoded_limit(len(body)) if limit is None else limit
    loadable = _bounded(body, limit)
    try:
        reply = torch.load(io.BytesIO(loadable), weights_only=True)
    except Exception as e:
        raise WireError(f"a reply that is not plain data ({type(e).__name__})") from None
    if type(reply) is not dict:
        raise WireError("a reply that is not a dict")
    return plain(reply, budget=[1_000_000, limit])


def plain(value: Any, depth: int = 0, budget: list | None = None) -> Any:
    """Validate loaded data: exact built-in types and plain CPU tensors only; opaque stand-ins
    become `Opaque`. Raises WireError on anything else. `budget`: [items, bytes] left: the
    items walked, and the bytes the tensors span (a view of a one-element storage may claim
    gigabytes, which a check would build as soon as it computed with it)."""
    budget = [1_000_000, MAX_BYTES] if budget is None else budget
    budget[0] -= 1
    if depth > 24 or budget[0] < 0:
        raise WireError("a reply nested too deep or too large")
    kind = type(value)
    if kind is torch.nn.Parameter:
        value, kind = value.detach(), torch.Tensor
    if kind is torch.Tensor:
        if value.layout != torch.strided or value.device.type != "cpu" or value.is_quantized:
            raise WireError("a tensor that is not a plain strided CPU tensor")
        budget[1] -= value.numel() * value.element_size()
        if budget[1] < 0:
            raise WireError(f"a reply whose tensors span more than the grader's limit "
                            f"(a tensor of shape {tuple(value.shape)})")
        return value
    if kind in _SCALARS:
        return value
    if kind in (tuple, list):
        return kind(plain(v, depth + 1, budget) for v in value)
    if kind is dict:
        if _OPAQUE in value:
            return _opaque_class(str(value[_OPAQUE]))(str(value.get("repr", ""))[:300])
        if not all(_plain_key(k) for k in value):
            raise WireError("a dict with keys that are not plain (str, int, or short tuples "
                            "of them)")
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
