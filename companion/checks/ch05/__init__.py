"""Checks for chapter 05, mixed precision, in the notebook's order: which layout to train in, a
prediction of activation bytes under autocast, a dynamic loss scale over recorded traces,
unscaling with inf/NaN detection, the FP8 cast with its scale, and current against delayed
scaling on recorded traces.

Modules, one per exercise, in the notebook's order: `layout`, `autocast_bytes`, `loss_scale`,
`unscale`, `e4m3`, `scaling_choice`."""
from companion.checks.ch05.layout import check_bf16_layout
from companion.checks.ch05.autocast_bytes import check_autocast_activation_bytes
from companion.checks.ch05.loss_scale import check_replay_loss_scale
from companion.checks.ch05.unscale import check_unscale_grads
from companion.checks.ch05.e4m3 import check_to_e4m3
from companion.checks.ch05.scaling_choice import check_choose_scaling

__all__ = ["check_bf16_layout", "check_autocast_activation_bytes", "check_replay_loss_scale",
           "check_unscale_grads", "check_to_e4m3", "check_choose_scaling"]
