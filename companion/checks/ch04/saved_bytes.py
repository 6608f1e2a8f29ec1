"""Chapter 04, exercise 1: the bytes autograd saves for backward, each storage counted once."""
from __future__ import annotations

import torch

from companion import checkpointing
from companion.checks.core import call, call_inplace, compare, exercise, fresh_seeds, harness

__all__ = ["check_saved_bytes"]


def _block(seed: int, width: int, p: float) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, 3 * width), torch.nn.GELU(),
                               torch.nn.Dropout(p), torch.nn.Linear(3 * width, width), torch.nn.Tanh())


def _square(t: torch.Tensor) -> torch.Tensor:
    return t * t


def _sigmoid_exp_matmul(t: torch.Tensor) -> torch.Tensor:
    return t.sigmoid().exp() @ t.T


def _slices_product(t: torch.Tensor) -> torch.Tensor:
    """Saves two slices of one storage (as attention saves q, k and v cut from one qkv output)."""
    doubled = t * 2                                # column 1 is saved by neither slice
    first, rest = doubled[:, :1], doubled[:, 2:]   # (rows, 1), (rows, width - 2)
    return (first * rest) * rest                   # rest is saved twice


def _flat_second_layer(seed: int, width: int) -> torch.nn.Module:
    """The second Linear of a two-layer model whose four parameters are views of one flat
    buffer, as FSDP and ZeRO flatten a model's parameters: its weight starts inside the buffer,
    not at its first byte."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(width, width), torch.nn.Linear(width, width)]
    flat = torch.cat([p.detach().reshape(-1) for layer in layers for p in layer.parameters()])
    start = 0
    for layer in layers:
        for name in ("weight", "bias"):
            p = getattr(layer, name)
            setattr(layer, name, torch.nn.Parameter(flat[start:start + p.numel()].view_as(p)))
            start += p.numel()
    return layers[1]


def _input(seed: int, width: int, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed),
                       requires_grad=True)


@harness
def _flat_layer_saved(answer, seed: int, width: int):
    """The answer's bytes for `_flat_second_layer` on the check's input, both made here: a copy
    for the answer (`call`) would give each parameter a storage of its own (a Parameter's
    deepcopy clones its data), and the shared buffer would be gone."""
    return call_inplace(answer, _flat_second_layer(seed, width), _input(seed, width, 7))


def _parameter_pointer_bytes(fn, x) -> int:
    """Known wrong: parameters told apart by p.data_ptr(), where each one starts, not by the
    storage that holds it."""
    params = {p.data_ptr() for p in fn.parameters()} if isinstance(fn, torch.nn.Module) else set()
    storages: dict[int, int] = {}
    for s in checkpointing.saved_for_backward(fn, x):
        if s.storage not in params:
            storages[s.storage] = s.storage_nbytes
    return sum(storages.values())


def _view_bytes(fn, x) -> int:
    """Known wrong: each saved view counted by its own bytes, views told apart by t.data_ptr()."""
    views: dict[int, int] = {}
    for t in _saved_tensors(fn, x):
        views[t.data_ptr()] = t.numel() * t.element_size()
    return sum(views.values())


def _saved_tensors(fn, x) -> list[torch.Tensor]:
    """The non-parameter tensors fn(x) saves for backward."""
    params = {p.data_ptr() for p in fn.parameters()} if isinstance(fn, torch.nn.Module) else set()
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x)
    return [t for t in saved if t.untyped_storage().data_ptr() not in params]


def _first_view_bytes(fn, x) -> int:
    """Known wrong: the bytes of the first view seen of each storage, not the storage's size."""
    first: dict[int, int] = {}
    for s in checkpointing.saved_for_backward(fn, x):
        if not s.is_parameter:
            first.setdefault(s.storage, s.nbytes)
    return sum(first.values())


@exercise(points=1, reference=("companion.checkpointing.activation_bytes",
                               "companion.checkpointing.saved_for_backward",
                               "companion.checks.ch04.saved_bytes._saved_tensors"))
def check_saved_bytes(answer) -> str:
    """answer(fn, x) -> int: bytes of the tensors `fn(x)` saves for backward that are not
    parameters of `fn`, each storage counted once and whole."""
    for seed, width in zip(fresh_seeds(3), [5, 9, 16]):
        x = _input(seed, width, 7)
        block = _block(seed, width, 0.0)
        flat = _flat_second_layer(seed, width)
        cases = [(block, "an MLP block"), (_square, "x * x"),
                 (_sigmoid_exp_matmul, "sigmoid, exp, matmul"),
                 (_slices_product, "two slices of one tensor, multiplied"),
                 (flat, "the second layer of a model whose parameters share one flat buffer "
                  "(as FSDP flattens them)")]
        for fn, label in cases:
            want = checkpointing.activation_bytes(fn, x)
            saved = checkpointing.saved_for_backward(fn, x)
            with_params = sum({s.storage: s.storage_nbytes for s in saved}.values())
            every_save = sum(s.nbytes for s in saved if not s.is_parameter)
            # the first match is the hint: on the flat buffer, parameters told apart by where
            # they start give what counting the parameters does, and that answer kept them out
            # of the MLP block already
            wrong = {
                "a parameter can be a view into a larger buffer (here one flat buffer holds "
                "both layers' parameters, and this layer's start inside it): where a parameter "
                "starts is not where its storage starts.": _parameter_pointer_bytes(fn, x),
                "a tensor saved twice (x * x saves x twice, and a ReLU's output is saved again by "
                "the next Linear) exists once: count each storage once "
                "(t.untyped_storage().data_ptr()).": every_save,
                "leave out the parameters: the weights are in memory anyway, with or without "
                "backward (compare storages with fn.parameters()).": with_params,
                "a saved view keeps its whole storage alive: count t.untyped_storage().nbytes(), "
                "not the first view's numel() * element_size() (two slices of one tensor hold "
                "all of it).": _first_view_bytes(fn, x),
                "views of one tensor share its storage: tell storages apart by "
                "t.untyped_storage().data_ptr(), not t.data_ptr() (a slice starts elsewhere in "
                "the same storage).": _view_bytes(fn, x),
            }
            got = _flat_layer_saved(answer, seed, width) if fn is flat else call(answer, fn, x)
            compare(got, want, name=f"bytes saved by {label}",
                    hint="pack every tensor with torch.autograd.graph.saved_tensors_hooks and add "
                         "t.untyped_storage().nbytes() for each new storage.", known_wrong=wrong)
    return "you can see what autograd keeps: the inputs of each layer, not the weights"
