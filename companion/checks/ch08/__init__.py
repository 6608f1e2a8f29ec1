"""Checks for chapter 08, offload. The learner's hooks and step run inside `@harness` functions,
which return raw observations (tensors, byte counts); the verdicts are taken here.

Modules, one per exercise, in the notebook's order: `offloaded_step` (the optimizer step on the
host), `offload_plan` (the fastest rung of the offload ladder that fits), `pipeline` (overlapping
copies and host steps), `activation_hooks` (pack and unpack saved activations); `_common` holds
what two of them share."""
from companion.checks.ch08.offloaded_step import check_offloaded_step
from companion.checks.ch08.offload_plan import check_offload_plan
from companion.checks.ch08.pipeline import check_offload_schedule
from companion.checks.ch08.activation_hooks import check_offload_hooks

__all__ = ["check_offloaded_step", "check_offload_plan", "check_offload_schedule",
           "check_offload_hooks"]
