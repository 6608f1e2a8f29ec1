"""Automatic mixed precision: loss scaling, fp32 master weights, and what autocast runs in 16 bits.

Mixed precision runs the matrix multiplies in a 16-bit format (bf16 or fp16) and keeps what needs
range or precision in fp32. It halves most *activations* (the tensors saved for backward), not
the *model states*: with Adam both layouts below hold 16 bytes per parameter.
- torch.amp (autocast): fp32 parameters (4) + fp32 gradients (4) + Adam (8). Autocast casts each
  weight to 16 bits in forward; those copies are saved for backward and freed there.
- 16-bit model + fp32 master copy (Megatron-LM, DeepSpeed): 16-bit parameters (2) + 16-bit
  gradients (2) + fp32 master weights and Adam (12). `MasterWeights` builds it.

Modules:
- `scaler`: fp16's loss scaling: `update_scale` (the rule), `unscale_grads_`, `GradScaler`.
- `sharded`: `ShardedGradScaler`, whose inf check every rank of a sharded model agrees on.
- `master`: `MasterWeights`, the 16-bit model with an fp32 copy for the optimizer.
- `autocast`: `autocast_dtypes`, which operators autocast ran in which dtype.

Example:
    >>> scaler = GradScaler("cpu")
    >>> with torch.autocast("cpu", dtype=torch.float16):
    ...     loss = model.loss(x, y)
    >>> scaler.scale(loss).backward()
    >>> scaler.step(opt); scaler.update(); opt.zero_grad()

Simplified vs PyTorch: see each module's docstring.
"""
from companion.amp.autocast import OpDtype, autocast_dtypes
from companion.amp.master import MasterWeights
from companion.amp.scaler import GradScaler, unscale_grads_, update_scale
from companion.amp.sharded import ShardedGradScaler

__all__ = ["GradScaler", "ShardedGradScaler", "update_scale", "unscale_grads_", "MasterWeights",
           "OpDtype", "autocast_dtypes"]
