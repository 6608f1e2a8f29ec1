"""Automatic mixed precision: loss scaling, fp32 master weights, and what autocast runs in 16 bits.

Mixed precision runs the matrix multiplies in a 16-bit format (bf16 or fp16) and keeps what needs
range or precision in fp32. It shrinks most *activations* (the tensors saved for backward; to 0.60
of fp32's on the course GPT, not to half), not the *model states*: with Adam, 16 bytes per
parameter or more.
- torch.amp (autocast): fp32 parameters (4) + fp32 gradients (4) + Adam (8). Autocast casts each
  weight to 16 bits in forward; those copies are saved for backward and freed there.
- 16-bit model + fp32 master copy: 16-bit parameters (2) + gradients + fp32 master weights and
  Adam (12). The gradients: 16-bit (2, the ZeRO paper's 16 B), an fp32 buffer (4, Megatron-LM's
  bf16 default, 18 B) or both (6, DeepSpeed's bf16 optimizer, 20 B). `MasterWeights` builds each.

Modules:
- `scaler`: fp16's loss scaling: `update_scale` (the rule), `replay_scale` (the
  rule over a recorded trace), `unscale_grads_`, `GradScaler`.
- `sharded`: `ShardedGradScaler`, whose inf check every rank of a sharded model agrees on.
- `master`: `MasterWeights`, the 16-bit model with an fp32 copy for the optimizer.
- `autocast`: `autocast_dtypes`, which operators autocast ran in which dtype; `autocast_ops`,
  which operators autocast wraps on a device type.
- `syncs`: `host_reads`, how many values a step copies from the device to the host (GPU syncs).

Example:
    >>> scaler = GradScaler("cpu")
    >>> with torch.autocast("cpu", dtype=torch.float16):
    ...     loss = model.loss(x, y)
    >>> scaler.scale(loss).backward()
    >>> scaler.step(opt); scaler.update(); opt.zero_grad()

Simplified vs PyTorch: see each module's docstring.
"""
from companion.amp.autocast import OpDtype, autocast_dtypes, autocast_ops
from companion.amp.master import MasterWeights
from companion.amp.scaler import GradScaler, replay_scale, unscale_grads_, update_scale
from companion.amp.sharded import ShardedGradScaler
from companion.amp.syncs import host_reads, step_counters

__all__ = ["GradScaler", "ShardedGradScaler", "update_scale", "replay_scale", "unscale_grads_", "MasterWeights",
           "OpDtype", "autocast_dtypes", "autocast_ops", "host_reads", "step_counters"]
