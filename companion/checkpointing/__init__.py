"""Gradient checkpointing: keep a few activations, recompute the rest during backward.

Backward needs tensors from forward (a Linear layer needs its input to form the weight gradient, a
ReLU needs to know where its input was positive). Autograd saves them, so a deep network holds one
set of activations per layer until its backward runs. Checkpointing a block keeps only the block's
*inputs*, runs the block without keeping what it saves, and runs it again inside backward to get
the saved tensors back. It trades one extra forward pass (about a third more compute: backward costs
about two forwards) for activation memory. It does not change which parameters are trained: every
gradient is the same as without it.

Two designs, as in PyTorch's `torch.utils.checkpoint`:
- `function`: an autograd.Function whose backward reruns the block and calls backward on it
  (reentrant; `checkpoint(fn, x)`, the default here).
- `hooks`: saved-tensor hooks that recompute the block the first time backward unpacks a tensor
  (non-reentrant; `checkpoint(fn, x, use_reentrant=False)` or `checkpoint_hooks`), with an optional
  selective policy that keeps some operators' outputs.
`saved` lists what autograd saves; `segments` predicts and measures the √n trade-off, and plans
uneven segments for a budget and measures a plan's peak; `selective` is Korthikanti et al.'s
selective recomputation (only the attention core); `budget` lists a region's operators and
chooses per operator keep, recompute or offload for a byte budget, and `budget_run` runs that
choice through PyTorch's selective checkpointing and measures it until it fits; `compiled` is
torch.compile's own choice under `activation_memory_budget`, measured, and its curve over budgets;
`offload_inputs` checkpoints layer by layer with each checkpoint's input on the host, fetched back
one layer ahead of backward, and shows where the step's peak is with and without it; `tiled`
runs a per-token MLP a tile of tokens at a time, so that its wide intermediate never exists whole.

Example:
    >>> layers = [torch.nn.Linear(64, 64) for _ in range(16)]
    >>> y = checkpoint_sequential(layers, 4, torch.randn(8, 64, requires_grad=True))
    >>> y.sum().backward()                     # same gradients as running the layers plainly
"""
from companion.checkpointing.function import Checkpoint, checkpoint, checkpoint_sequential
from companion.checkpointing.hooks import (checkpoint_hooks, save_linear_outputs,
                                           save_matmul_outputs)
from companion.checkpointing.saved import SavedTensor, activation_bytes, saved_for_backward
from companion.checkpointing.segments import (SegmentRun, predicted_activation_bytes,
                                              predicted_activation_units, predicted_time_ratio,
                                              profile_segments, segments_for_budget, sqrt_segments,
                                              plan_cost, checkpoint_plan, UnevenLayer, measure_plan)
from companion.checkpointing.budget import (CHOICES, Region, RegionOp, RematPlan, region_ops,
                                            solve)
from companion.checkpointing.budget_run import (Fitted, checkpoint_with_plan, fit, held_bytes,
                                                plan_policy)
from companion.checkpointing.compiled import (TRACKED_BACKENDS, BudgetCurve, BudgetPoint,
                                              CompiledSaved, budget_curve, compiled_saved)
from companion.checkpointing.offload_inputs import (InputOffload, Overlap, PeakRow,
                                                    checkpoint_offloaded, transfer_hides,
                                                    where_is_the_peak)
from companion.checkpointing.selective import (attention_core, attention_core_policy,
                                               block_activation_bytes, megatron_activation_bytes,
                                               selective_block)
from companion.checkpointing.tiled import tiled_mlp

__all__ = [
    "Checkpoint",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_hooks",
    "save_linear_outputs",
    "save_matmul_outputs",
    "SavedTensor",
    "saved_for_backward",
    "activation_bytes",
    "predicted_activation_units",
    "predicted_activation_bytes",
    "segments_for_budget",
    "sqrt_segments",
    "predicted_time_ratio",
    "SegmentRun",
    "profile_segments",
    "plan_cost",
    "checkpoint_plan",
    "UnevenLayer",
    "measure_plan",
    "attention_core",
    "selective_block",
    "attention_core_policy",
    "block_activation_bytes",
    "megatron_activation_bytes",
    "InputOffload",
    "checkpoint_offloaded",
    "where_is_the_peak",
    "PeakRow",
    "transfer_hides",
    "Overlap",
    "CHOICES",
    "RegionOp",
    "Region",
    "RematPlan",
    "region_ops",
    "solve",
    "plan_policy",
    "checkpoint_with_plan",
    "held_bytes",
    "Fitted",
    "fit",
    "TRACKED_BACKENDS",
    "CompiledSaved",
    "compiled_saved",
    "BudgetPoint",
    "BudgetCurve",
    "budget_curve",
    "tiled_mlp",
]
