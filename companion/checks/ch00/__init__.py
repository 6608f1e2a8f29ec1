"""Checks for chapter 00, the anatomy of memory, in the notebook's order: Adam's step and its
state, model states per parameter in five layouts, the activations of an MLP (predicted, then
measured with `companion.memory.track`), and the activations of any GPT (Korthikanti et al.).

Modules, one per exercise, in the notebook's order: `adam_step`, `model_states`, `mlp_activations`,
`transformer_activations`."""
from companion.checks.ch00.adam_step import check_adam_step
from companion.checks.ch00.model_states import check_model_state_bytes
from companion.checks.ch00.mlp_activations import check_activation_bytes
from companion.checks.ch00.transformer_activations import check_transformer_activations

__all__ = ["check_adam_step", "check_model_state_bytes", "check_activation_bytes",
           "check_transformer_activations"]
