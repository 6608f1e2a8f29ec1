"""A tiled MLP: the MLP's wide intermediate never exists for all tokens at once.

An MLP works on each token alone, so its (tokens, 4C) intermediate (a Llama's (tokens, I), I ≈ 2.7C,
twice: gate and up) can be made a tile of tokens at a time. `tiled_mlp(mlp, x, tiles=k)` runs the
forward tile by tile under `torch.no_grad()`, keeping only x; backward runs each tile's forward
again with autograd and takes its gradients at once, so one tile's intermediate is alive at a
time. It is the chunked loss's idea (chapter 00) for the MLP, as Arctic Long Sequence Training's
`TiledMLP` does it (Bekman et al., 2025, arXiv:2506.13996, §3.2), for sequences of hundreds of
thousands of tokens where the MLP's intermediate outgrows attention's working memory.

Memory: saved for backward, x (held anyway by the caller in a residual block) instead of the
intermediates (a GPT MLP: fc's output and GELU's, 2·N·4C values); backward's peak holds one tile's
intermediates, 1/k of them. Cost: the MLP's forward runs twice, as under a whole-layer checkpoint.

Example:
    >>> y = tiled_mlp(lambda h: block.out(F.gelu(block.fc(h))), h, tiles=8,
    ...               params=[*block.fc.parameters(), *block.out.parameters()])
    >>> y.sum().backward()                              # the gradients of the plain MLP

Simplified vs ALST's TiledMLP: tiles split the flattened tokens (B·T rows) into k equal parts, not
a fixed tile size; gradients of the parameters are summed by autograd per tile, no hand-written
accumulation across DeepSpeed's ZeRO shards.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["tiled_mlp"]


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tiles, n_params, x, *params):
        ctx.fn, ctx.tiles = fn, tiles
        ctx.save_for_backward(x, *params)
        rows = x.reshape(-1, x.shape[-1])
        with torch.no_grad():                          # no intermediate outlives its tile
            out = torch.cat([fn(part) for part in rows.chunk(tiles)])
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        rows, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        wanted = [p for p in params if p.requires_grad]
        grad_x, grad_p = [], [torch.zeros_like(p) for p in wanted]
        for part, g in zip(rows.chunk(ctx.tiles), grad.chunk(ctx.tiles)):
            part = part.detach().requires_grad_(ctx.needs_input_grad[3])
            with torch.enable_grad():                  # this tile's intermediates, and only its
                out = ctx.fn(part)
            inputs = ([part] if part.requires_grad else []) + wanted
            got = torch.autograd.grad(out, inputs, g, allow_unused=True)
            if part.requires_grad:
                grad_x.append(got[0])
                got = got[1:]
            for total, one in zip(grad_p, got):
                if one is not None:
                    total += one
        grads = iter(grad_p)
        param_grads = [next(grads) if p.requires_grad else None for p in params]
        grad_x = torch.cat(grad_x).view(x.shape) if grad_x else None
        return (None, None, None, grad_x, *param_grads)


def tiled_mlp(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, tiles: int,
              params: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """`fn(x)` for a per-token `fn` (an MLP: (..., C) -> (..., C')), computed `tiles` parts of
    the tokens at a time, in forward and again in backward, with the same output and gradients.

    `params`: the tensors `fn` uses that need gradients (default: `fn.parameters()` when `fn` is
    a module). Memory: x saved instead of the intermediates; one tile's at a time. Cost: fn's
    forward twice.

        >>> y = tiled_mlp(llama_block.mlp, h, tiles=4, params=[
        ...     *llama_block.gate_proj.parameters(), *llama_block.up_proj.parameters(),
        ...     *llama_block.down_proj.parameters()])

    Raises ValueError for a tile count that is not a positive int, TypeError when params are
    missing for a plain function."""
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles is how many parts to cut the tokens into, an int >= 1; "
                         f"got {tiles!r}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise TypeError(f"x must be a tensor (..., C), got {type(x).__name__}")
    if params is None:
        if not isinstance(fn, torch.nn.Module):
            raise TypeError("fn is not a module, so its parameters are unknown: pass "
                            "params=[...] (the tensors it uses that need gradients)")
        params = list(fn.parameters())
    params = list(params)
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError("params must be tensors (the parameters fn uses)")
    return _Tiled.apply(fn, tiles, len(params), x, *params)
