"""Train fewer parameters: a low-rank adapter (LoRA) beside a frozen weight.

A weight W of shape (out, in) stays frozen; training learns only a low-rank update ΔW = s·B·A
with A (r, in), B (out, r) and r ≪ min(in, out) (Hu et al., 2021, "LoRA: Low-Rank Adaptation of
Large Language Models", section 4.1). B starts at zero, so the adapted model starts exactly where
the frozen one is, and s = alpha / r keeps the update's size steady when r changes.

Memory: the frozen weight needs no gradient and no optimizer state. With Adam in fp32, a layer
costs 4·in·out bytes (the weight alone) + 16·r·(in + out) bytes (the adapter's weight, gradient,
m and v) instead of 16·in·out: for in = out = 4096 and r = 8, 64 MiB + 1 MiB against 256 MiB.
A frozen weight kept in bf16 is 2 bytes per value (32 MiB here), and in NF4 about 0.52
(QLoRA, `companion.lowbit`: 8.3 MiB).
Activations are not reduced: backward still needs each layer's input (for A's gradient), and one
extra (N, r) tensor per layer.

Example:
    >>> model = apply_lora(GPT(vocab=64, seq_len=32, width=48, depth=2, heads=4), rank=4)
    >>> opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    >>> trainable_params(model)        # only the adapters' A and B

The whole model, as a PEFT user does it (PEFT 0.21.2's names in brackets):
    merge_lora(model)                 # W += s·B·A in place, adapters kept [merge_adapter()]
    unmerge_lora(model)               # W -= s·B·A: back to the adapters [unmerge_adapter()]
    merge_lora(model, unload=True)    # plain nn.Linear layers, merged [merge_and_unload()]
    unload_lora(model)                # plain nn.Linear layers, not merged [unload()]
    save_adapter(model, "out/")       # adapter_config.json + adapter_model.safetensors
    load_adapter(base_model, "out/")  # [PeftModel.from_pretrained(base_model, "out/")]
An adapter saved here loads in PEFT and one PEFT saved loads here, with the same outputs; the
merged weights equal PEFT's bit for bit (tests/test_lora.py, on a transformers Llama).

Simplified vs PEFT (Hugging Face's implementation; the same outputs, gradients and merged weights
are tested beside it): one adapter per layer (no named adapters to switch between), no dropout on
the adapter's input, nn.Linear and nn.MultiheadAttention only (no Embedding or Conv adapters: `apply_lora` warns
naming the layers it froze that hold weights it cannot adapt), one rank and alpha for the whole
model in the files (no rank_pattern; DoRA, rsLoRA, lora biases are refused by name on load), and
alpha defaults to r (a scale of 1) where PEFT's lora_alpha defaults to 8 (a scale of 8/r).

nn.MultiheadAttention reads its projections' weights directly (`in_proj_weight`,
`out_proj.weight`, in `F.multi_head_attention_forward`), so its Linear cannot be swapped for a
`LoRALinear`; its weights get a `LowRankDelta` parametrization instead, W + s·B·A formed at each
forward (as PEFT's MultiheadAttention layer merges on the fly): the same function and gradients,
at the cost of one dense (out, in) temporary and its gradient per projection during the step.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
import warnings
from typing import Iterable

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["LoRALinear", "LowRankDelta", "apply_lora", "adapter_parameters", "linear_targets",
           "trainable_params", "lora_params", "merge_lora", "unmerge_lora", "unload_lora",
           "save_adapter", "load_adapter"]


class LoRALinear(nn.Module):
    """y = x·Wᵀ + b + s·(x·Aᵀ)·Bᵀ, with W and b frozen and only A and B trained.

    Args:
        base: the nn.Linear to adapt; its weight and bias are frozen (requires_grad False) and
            kept as they are (the adapter does not copy them).
        rank: r, the rank of the update (1 <= r <= min(in, out)).
        alpha: the update's scale is s = alpha / r (default alpha = r, so s = 1).
    """

    def __init__(self, base: nn.Linear, rank: int, *, alpha: float | None = None):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear adapts an nn.Linear, got {type(base).__name__}")
        out_f, in_f = base.weight.shape
        self.A, self.B = adapter_parameters(in_f, out_f, rank, dtype=base.weight.dtype,
                                            device=base.weight.device)   # checks the rank
        self.base, self.rank = base, rank
        self.scale = (rank if alpha is None else alpha) / rank
        self.merged = False                  # True while W holds W + s·B·A (`merge_`)
        base.requires_grad_(False)                                    # frozen: no grad, no state

    # The base layer's attributes, read through the adapter as PEFT's layers let them be
    # (transformers' T5 reads `wo.weight.dtype`; others `in_features`). Not parameters of
    # the adapter: `parameters()` still lists W and b once, under `base`.
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged:                      # W already holds the update
            return self.base(x)
        # (..., in) -> (..., r) -> (..., out): two thin matmuls, never the (out, in) product B·A
        return self.base(x) + (x @ self.A.T @ self.B.T) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """s·B·A in the weight's dtype, computed as PEFT's `LoraLayer.get_delta_weight` does:
        (B @ A) · s, in fp32 for a 16-bit adapter on the CPU, so that merged weights equal
        PEFT's bit for bit."""
        A, B = self.A.detach(), self.B.detach()
        low = A.device.type == "cpu" and A.dtype in (torch.float16, torch.bfloat16)
        if low:
            A, B = A.float(), B.float()
        return ((B @ A) * self.scale).to(self.base.weight.dtype)

    def merged_weight(self) -> torch.Tensor:
        """W + s·B·A, the weight of one nn.Linear that computes the same function."""
        if self.merged:
            return self.base.weight.detach().clone()
        return self.base.weight.detach() + self.delta_weight()

    def merge_(self) -> None:
        """Add s·B·A into the frozen weight in place (PEFT's `LoraLayer.merge`); forward then
        runs the base Linear alone. `unmerge_` takes it out again (up to rounding:
        W + Δ − Δ)."""
        if self.merged:
            raise ValueError("this adapter is already merged: unmerge_ first")
        with torch.no_grad():
            self.base.weight += self.delta_weight()
        self.merged = True

    def unmerge_(self) -> None:
        """Subtract s·B·A from the weight again (PEFT's `LoraLayer.unmerge`)."""
        if not self.merged:
            raise ValueError("this adapter is not merged: nothing to unmerge")
        with torch.no_grad():
            self.base.weight -= self.delta_weight()
        self.merged = False

    def merge(self) -> nn.Linear:
        """A plain nn.Linear with the merged weight (and the base's bias): no extra cost at
        inference."""
        out_f, in_f = self.base.weight.shape
        merged = nn.Linear(in_f, out_f, bias=self.base.bias is not None,
                           dtype=self.base.weight.dtype, device=self.base.weight.device)
        with torch.no_grad():
            merged.weight.copy_(self.merged_weight())
            if self.base.bias is not None:
                merged.bias.copy_(self.base.bias)
        return merged

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}" + (", merged" if self.merged else "")


class LowRankDelta(nn.Module):
    """A parametrization W -> W + s·B·A (`torch.nn.utils.parametrize`), for weights a module reads
    directly instead of through an nn.Linear (nn.MultiheadAttention's projections)."""

    def __init__(self, weight: torch.Tensor, rank: int, *, alpha: float | None = None):
        super().__init__()
        out_f, in_f = weight.shape
        self.A, self.B = adapter_parameters(in_f, out_f, rank, dtype=weight.dtype,
                                            device=weight.device)
        self.rank, self.scale = rank, (rank if alpha is None else alpha) / rank
        self.merged = False                  # True while the stored weight holds the update

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.merged:
            return weight
        return weight + self.scale * (self.B @ self.A)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, scale={self.scale:g}"


_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _adapt_attention(mha: nn.MultiheadAttention, rank: int, alpha: float | None) -> None:
    """LowRankDelta on each projection weight of `mha` (packed or separate q, k, v; and out)."""
    for owner, name in [(mha, n) for n in _MHA_WEIGHTS] + [(mha.out_proj, "weight")]:
        weight = getattr(owner, name, None)
        if isinstance(weight, nn.Parameter):
            parametrize.register_parametrization(owner, name,
                                                 LowRankDelta(weight, rank, alpha=alpha))


def _inside_attention(model: nn.Module) -> set[str]:
    """Names of the nn.Linear layers that belong to an nn.MultiheadAttention (its out_proj)."""
    return {f"{name}.{child}" if name else child
            for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)
            for child, _ in m.named_children()}


def _unadapted_weights(model: nn.Module) -> list[str]:
    """Frozen layers holding a matrix (or larger) that LoRA here cannot adapt: convolutions and
    other modules that are neither nn.Linear, nn.Embedding nor adapted attention."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding, LoRALinear, LowRankDelta, nn.MultiheadAttention,
                          parametrize.ParametrizationList)) or parametrize.is_parametrized(m):
            continue
        if any(p.dim() >= 2 and not p.requires_grad for p in m.parameters(recurse=False)):
            names.append(f"{name or '(model)'} ({type(m).__name__})")
    return names


def adapter_parameters(in_f: int, out_f: int, rank: int, *, dtype: torch.dtype,
                       device: torch.device | str | None = None
                       ) -> tuple[nn.Parameter, nn.Parameter]:
    """A (rank, in) initialised as nn.Linear initialises a weight, and B (out, rank) at zero, so
    that a fresh adapter changes nothing. Shared with `companion.lowbit.QLoRALinear`."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(in_f, out_f):
        raise ValueError(f"rank must be an int from 1 to min(in, out) = {min(in_f, out_f)}, "
                         f"got {rank!r}")
    A = nn.Parameter(torch.empty(rank, in_f, dtype=dtype, device=device))    # (r, in)
    B = nn.Parameter(torch.zeros(out_f, rank, dtype=dtype, device=device))   # (out, r): zero
    nn.init.kaiming_uniform_(A, a=math.sqrt(5))
    return A, B


def _wanted(name: str, module: nn.Module, targets) -> bool:
    if targets is None:
        return True
    for target in targets:
        if isinstance(target, type) and isinstance(module, target):
            return True
        if isinstance(target, str) and (name == target or name.endswith("." + target)):
            return True
    return False


def apply_lora(model: nn.Module, rank: int, targets: Iterable[str | type] | None = None, *,
               alpha: float | None = None) -> nn.Module:
    """Freeze every parameter of `model` and put a LoRA adapter on the chosen nn.Linear layers
    and nn.MultiheadAttention modules (each projection weight: see the module docstring).

    `targets`: names of layers ("qkv" matches every "blocks.N.qkv"; a full dotted name matches one)
    or module types; default every nn.Linear and nn.MultiheadAttention. Edits `model` in place and
    returns it. A target name that matches no such layer is an error (a typo would otherwise
    train nothing). Warns naming the layers it froze whose weights it cannot adapt (a CNN's
    convolutions: only its Linear layers would train)."""
    targets = None if targets is None else list(targets)
    attention = [(n, m) for n, m in model.named_modules()
                 if isinstance(m, nn.MultiheadAttention) and _wanted(n, m, targets)]
    chosen = linear_targets(model, targets, allow_empty=bool(attention),
                            also=[n for n, _ in attention])
    model.requires_grad_(False)
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linear, rank, alpha=alpha))
    for _, mha in attention:
        _adapt_attention(mha, rank, alpha)
    frozen = _unadapted_weights(model)
    if frozen:
        warnings.warn(f"apply_lora froze {len(frozen)} layer(s) whose weights it cannot adapt "
                      f"(only nn.Linear and nn.MultiheadAttention get adapters): "
                      f"{', '.join(frozen[:8])}{' ...' if len(frozen) > 8 else ''}. They will not "
                      "train; unfreeze them with requires_grad_(True) if they should.",
                      stacklevel=2)
    return model


def linear_targets(model: nn.Module, targets: Iterable[str | type] | None = None, *,
                   allow_empty: bool = False, also: Iterable[str] = ()
                   ) -> list[tuple[str, nn.Linear]]:
    """The (name, nn.Linear) pairs of `model` that `targets` choose (see `apply_lora`), leaving out
    the Linear layers inside nn.MultiheadAttention (it reads their weights directly); a target
    name that matches no nn.Linear (nor one of the names in `also`), or no Linear at all (unless
    `allow_empty`), is an error that lists the names."""
    targets = None if targets is None else list(targets)
    inside = _inside_attention(model)
    chosen = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name and name not in inside
              and _wanted(name, m, targets)]
    also = list(also)
    for target in targets or []:
        if isinstance(target, str) and not any(_wanted(n, m, [target]) for n, m in chosen) \
                and not any(_wanted(n, None, [target]) for n in also):
            linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                              if isinstance(m, nn.Linear) and n not in inside})
            attention = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                                if isinstance(m, nn.MultiheadAttention)})
            raise ValueError(f"no nn.Linear named {target!r} in the model; its Linear layers are "
                             f"called {', '.join(linears) or 'nothing'}"
                             + (f", its nn.MultiheadAttention {', '.join(attention)}"
                                if attention else ""))
    if not chosen and not allow_empty:
        raise ValueError("no nn.Linear layer to adapt: pass targets that name Linear layers")
    return chosen


def trainable_params(model: nn.Module) -> int:
    """Parameters that will get a gradient and optimizer state (requires_grad), each counted
    once."""
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    return sum(p.numel() for p in trainable.values())


def lora_params(in_features: int, out_features: int, rank: int) -> int:
    """Trainable parameters of one adapter: r·(in + out)."""
    return rank * (in_features + out_features)


# ------------------------------------------------------------------ the whole model, as PEFT does

def _adapters(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of each LoRALinear and QLoRALinear in `model`."""
    from companion.lowbit.qlora import QLoRALinear
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LoRALinear, QLoRALinear))]


def _deltas(model: nn.Module) -> list[tuple[nn.Module, str, LowRankDelta]]:
    """(owner, weight name, LowRankDelta) of each adapted nn.MultiheadAttention weight."""
    return [(m, name, p) for m in model.modules() if parametrize.is_parametrized(m)
            for name, plist in m.parametrizations.items()
            for p in plist if isinstance(p, LowRankDelta)]


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _tied(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """{adapter name: the other module's parameter} for each adapted weight that another module
    of `model` holds too (a head tied to the input embedding)."""
    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    found = {}
    for name, layer in layers:
        others = [o for o in owners.get(id(layer.base.weight), [])
                  if not o.startswith(f"{name}.")]
        if others:
            found[name] = others[0]
    return found


def merge_lora(model: nn.Module, *, unload: bool = False) -> nn.Module:
    """Merge every adapter of `model` into its frozen weight, W <- W + s·B·A, in place.

    `unload=False` (PEFT's `model.merge_adapter()`): the adapters stay, their layers run the
    merged weight alone (no extra matmul), and `unmerge_lora(model)` takes the update out again.
    `unload=True` (PEFT's `model.merge_and_unload()`): each LoRALinear is replaced by its own
    nn.Linear holding the merged weight, each adapted nn.MultiheadAttention keeps a plain merged
    weight, and the adapters are gone: a model of plain layers for inference or export. Either
    way the merged weights equal PEFT's bit for bit (`LoRALinear.delta_weight`), and every
    parameter stays frozen as `apply_lora` left it (PEFT's do too). Returns `model`.

    A weight another module shares (an output head tied to the input embedding) cannot take the
    update in place without changing that module too: `unload=False` refuses it by name, and
    `unload=True` gives the adapted layer a merged weight of its own (the tie is broken; the
    embedding keeps its trained values). PEFT 0.21.2 only warns when such a layer is targeted.

    A QLoRA layer (`lowbit.QLoRALinear`, an NF4 base) cannot take the update in place: an error
    names it. An adapter already merged is an error (merge twice would add the update twice)."""
    from companion.lowbit.qlora import QLoRALinear
    layers, deltas = _adapters(model), _deltas(model)
    if not layers and not deltas:
        raise ValueError("the model has no LoRA adapter to merge (apply_lora or load_adapter "
                         "puts them on)")
    nf4 = [n for n, m in layers if isinstance(m, QLoRALinear)]
    if nf4:
        raise ValueError(f"cannot merge into an NF4 weight ({', '.join(nf4[:4])}"
                         f"{' ...' if len(nf4) > 4 else ''}): QLoRA's base is 4-bit codes; save "
                         "the adapter (save_adapter) and merge it into a 16- or 32-bit base")
    done = [n for n, m in layers if m.merged] + [type(o).__name__ for o, _, d in deltas if d.merged]
    if done:
        raise ValueError(f"already merged: {', '.join(done[:4])}; unmerge_lora(model) first")
    tied = _tied(model, layers)
    if tied and not unload:
        raise ValueError(f"cannot merge in place into a weight another module shares "
                         f"({'; '.join(f'{a} is {b}' for a, b in list(tied.items())[:3])}): the "
                         f"update would change that module too (tied input and output "
                         f"embeddings). merge_lora(model, unload=True) gives the adapted layer a "
                         f"merged weight of its own, or leave it out of apply_lora's targets")
    for name, layer in layers:
        if name in tied:                     # its own merged copy; the shared weight untouched
            _replace(model, name, layer.merge())
            continue
        layer.merge_()
        if unload:
            _replace(model, name, layer.base)
    for owner, name, delta in deltas:
        with torch.no_grad():
            getattr(owner.parametrizations, name).original += delta.scale * (delta.B @ delta.A)
        delta.merged = True
    if unload:
        for owner, name, _ in deltas:
            parametrize.remove_parametrizations(owner, name, leave_parametrized=True)
            getattr(owner, name).requires_grad_(False)
    return model


def unmerge_lora(model: nn.Module) -> nn.Module:
    """Take every merged adapter's update out of its weight again (PEFT's
    `model.unmerge_adapter()`): W <- W − s·B·A, after which the adapters run beside the frozen
    weight as before `merge_lora`. The weights come back up to rounding (W + Δ − Δ in floating
    point, as PEFT's). After `merge_lora(model, unload=True)` there is nothing left to unmerge:
    an error says so. Returns `model`."""
    layers, deltas = _adapters(model), _deltas(model)
    if not layers and not deltas:
        raise ValueError("the model has no LoRA adapter (merge_lora(model, unload=True) removes "
                         "them; unmerge works after merge_lora(model))")
    merged = [m for _, m in layers if getattr(m, "merged", False)]
    merged_deltas = [(o, n, d) for o, n, d in deltas if d.merged]
    if not merged and not merged_deltas:
        raise ValueError("no adapter of the model is merged: nothing to unmerge")
    for layer in merged:
        layer.unmerge_()
    for owner, name, delta in merged_deltas:
        with torch.no_grad():
            getattr(owner.parametrizations, name).original -= delta.scale * (delta.B @ delta.A)
        delta.merged = False
    return model


def unload_lora(model: nn.Module) -> nn.Module:
    """Drop every adapter and give back the base layers as they were, not merged (PEFT's
    `model.unload()`); a merged adapter is unmerged first. Returns `model`."""
    from companion.lowbit.qlora import QLoRALinear
    layers = _adapters(model)
    nf4 = [n for n, m in layers if isinstance(m, QLoRALinear)]
    if nf4:
        raise ValueError(f"cannot unload a QLoRA layer to an nn.Linear ({nf4[0]}): its base is "
                         "NF4 codes")
    if not layers and not _deltas(model):
        raise ValueError("the model has no LoRA adapter to unload")
    for name, layer in layers:
        if layer.merged:
            layer.unmerge_()
        _replace(model, name, layer.base)
    for owner, name, delta in _deltas(model):
        if delta.merged:
            with torch.no_grad():
                getattr(owner.parametrizations, name).original -= delta.scale * (delta.B @ delta.A)
        parametrize.remove_parametrizations(owner, name, leave_parametrized=False)
    return model


# ------------------------------------------------------------------------- PEFT's adapter files
# A PEFT adapter folder (`PeftModel.save_pretrained`, PEFT 0.21.2): adapter_config.json (a
# LoraConfig's fields) and adapter_model.safetensors, one tensor per A and B named by the adapted
# layer's path in the base model under PeftModel's two wrappers, the adapter's name left out:
# "base_model.model." + "model.layers.0.self_attn.q_proj" + ".lora_A.weight" (`lora_A` is
# nn.Linear(in, r): our A (r, in); `lora_B` nn.Linear(r, out): our B (out, r)). Read from
# peft/utils/save_and_load.py (get_peft_model_state_dict) and checked against PEFT's own files in
# tests/test_lora.py.
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."

# adapter_config.json keys that change what the adapter computes and that this module does not
# do: a non-empty value is refused by name (an empty one, None, False, {} or [], is the default).
# Any other key not in _UNDERSTOOD is treated the same way, so a feature PEFT adds later is
# refused, not ignored.
_UNDERSTOOD = {"peft_type", "task_type", "r", "lora_alpha", "target_modules", "exclude_modules",
               "lora_dropout", "bias", "init_lora_weights", "base_model_name_or_path",
               "revision", "inference_mode", "peft_version", "auto_mapping", "megatron_core",
               "qalora_group_size", "loftq_config"}
_WHY = {"use_dora": "DoRA (a learned magnitude per output)",
        "use_rslora": "rank-stabilised scaling (alpha / sqrt(r))",
        "rank_pattern": "a rank per layer", "alpha_pattern": "an alpha per layer",
        "lora_bias": "a bias on lora_B", "fan_in_fan_out": "transposed (Conv1D) weights",
        "modules_to_save": "fully trained modules beside the adapters",
        "layers_to_transform": "adapters on chosen layers only",
        "layers_pattern": "adapters on chosen layers only",
        "target_parameters": "adapters on parameters (MoE experts)",
        "trainable_token_indices": "trained token embeddings",
        "layer_replication": "replicated layers", "use_qalora": "QALoRA",
        "alora_invocation_tokens": "activated LoRA", "megatron_config": "Megatron layers"}


def _empty(value) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def _peft_targets(model: nn.Module, target_modules, exclude=None) -> list[str]:
    """The nn.Linear layers PEFT adapts for `target_modules` (peft/tuners/tuners_utils.py,
    `check_target_module_exists`): a list matches a module whose name equals an entry or ends
    with "." + entry; a string is a regular expression the whole name must match; "all-linear"
    is every nn.Linear but the output layer (`get_output_embeddings()`). `exclude` (PEFT's
    exclude_modules) takes names out by the same rules."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]

    def matches(name, spec):
        if isinstance(spec, str):
            return re.fullmatch(spec, name) is not None
        return any(name == t or name.endswith("." + t) for t in spec)
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        output = getattr(model, "get_output_embeddings", lambda: None)()
        chosen = [n for n in linears if model.get_submodule(n) is not output]
    else:
        chosen = [n for n in linears if matches(n, target_modules)]
    return [n for n in chosen if _empty(exclude) or not matches(n, exclude)]


def _check_peft_config(config, where: str) -> None:
    if not isinstance(config, dict):
        raise ValueError(f"{where}: not an adapter config (a JSON object of LoraConfig's fields)")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r}: only LoRA adapters "
                         "(peft_type \"LORA\") load here")
    refused = [key for key, value in config.items()
               if key not in _UNDERSTOOD and not _empty(value)]
    if config.get("bias", "none") != "none":
        refused.append("bias")
    init = config.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init == "gaussian"):
        refused.append("init_lora_weights")     # PiSSA, OLoRA, CorDA, LoftQ... edit the base
    if refused:
        what = "; ".join(f"{k} = {json.dumps(config.get(k))}"
                         + (f" ({_WHY[k]})" if k in _WHY else "") for k in refused)
        raise ValueError(f"{where}: this adapter uses what companion.lora does not do: {what}. "
                         "Only plain LoRA on nn.Linear layers (one r and lora_alpha for all, "
                         "bias \"none\") loads here; use PEFT for the rest")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: 'r' must be a positive whole number, got {json.dumps(r)}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: 'lora_alpha' must be a number, got {json.dumps(alpha)}")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets
                                         and all(isinstance(t, str) for t in targets))):
        raise ValueError(f"{where}: 'target_modules' must be a list of layer names or a "
                         f"regular expression, got {json.dumps(targets)}")


def save_adapter(model: nn.Module, folder, *, base_model_name_or_path: str | None = None
                 ) -> pathlib.Path:
    """Write `model`'s adapters as PEFT writes them (`PeftModel.save_pretrained`): `folder`/
    adapter_config.json and `folder`/adapter_model.safetensors, which
    `PeftModel.from_pretrained(base_model, folder)` loads onto the same base model (and
    `load_adapter` here). Every adapter must share one rank and one scale (PEFT's r and
    lora_alpha = scale·r); target_modules lists the adapted layers' last names when those pick
    out exactly the adapted layers, else their full names. task_type is "CAUSAL_LM" for a
    transformers *ForCausalLM model (PEFT then wraps it in PeftModelForCausalLM), else null.
    Adapters on nn.MultiheadAttention are not written (PEFT names those differently): an error.
    Returns the folder."""
    from safetensors.torch import save_file
    layers = _adapters(model)
    if _deltas(model):
        raise ValueError("adapters on nn.MultiheadAttention (LowRankDelta) are not written in "
                         "PEFT's format here; only those on nn.Linear layers")
    if not layers:
        raise ValueError("the model has no LoRA adapter to save (apply_lora puts them on)")
    if any(getattr(m, "merged", False) for _, m in layers):
        raise ValueError("the adapters are merged into their weights: unmerge_lora(model) "
                         "first, so that the base model PEFT loads them onto stays the base")
    ranks = {m.rank for _, m in layers}
    scales = {m.scale for _, m in layers}
    if len(ranks) > 1 or len(scales) > 1:
        raise ValueError(f"the adapters have ranks {sorted(ranks)} and scales {sorted(scales)}: "
                         "one r and one lora_alpha for all is what this writes (PEFT's "
                         "rank_pattern is not)")
    rank, scale = ranks.pop(), scales.pop()
    alpha = scale * rank
    alpha = round(alpha) if abs(alpha - round(alpha)) < 1e-9 else alpha
    names = [n for n, _ in layers]
    short = sorted({n.rsplit(".", 1)[-1] for n in names})
    # what PEFT would pick with the short names, on the base model: every module, adapted
    # layers by their own name, nothing inside them
    inside = tuple(n + "." for n in names)
    base_names = [n for n, _ in model.named_modules() if n and not n.startswith(inside)]
    picked = [n for n in base_names if any(n == t or n.endswith("." + t) for t in short)]
    targets = short if sorted(picked) == sorted(names) else sorted(names)
    config = {"peft_type": "LORA",
              "task_type": "CAUSAL_LM" if type(model).__name__.endswith("ForCausalLM") else None,
              "base_model_name_or_path": base_model_name_or_path
              or getattr(getattr(model, "config", None), "_name_or_path", None) or None,
              "r": rank, "lora_alpha": alpha,
              "target_modules": targets, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}}
    tensors = {}
    for name, layer in layers:
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = layer.A.detach().contiguous()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = layer.B.detach().contiguous()
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return folder


def load_adapter(model: nn.Module, folder) -> nn.Module:
    """Put the adapter PEFT saved in `folder` (adapter_config.json + adapter_model.safetensors,
    `PeftModel.save_pretrained`) on `model`, the base model it was trained on: `apply_lora` on the
    layers its target_modules pick (by PEFT's rules), with its r and lora_alpha, then its A and B
    weights. The outputs equal `PeftModel.from_pretrained(model, folder)`'s. Edits `model` in
    place and returns it (frozen, adapters trainable).

    Refused, by name, before the model is touched: a missing file; a pickled adapter_model.bin
    (older PEFT; load it in PEFT and save again, safe_serialization=True); a config using what
    this module does not do (DoRA, rsLoRA, rank_pattern/alpha_pattern, bias other than "none",
    modules_to_save, ...: `_WHY`); weights for layers the config does not pick, or missing for
    some, or of the wrong shape; a model that already has adapters. lora_dropout is read but not
    applied (no dropout here: the same outputs, a different training step): a warning says so."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    folder = pathlib.Path(folder)
    config_path, weights_path = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not folder.is_dir():
        raise FileNotFoundError(f"no adapter folder {folder} (PeftModel.save_pretrained and "
                                f"save_adapter write one, with {ADAPTER_CONFIG} and "
                                f"{ADAPTER_WEIGHTS})")
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: no such file; a PEFT adapter folder holds "
                                f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    if not weights_path.is_file():
        old = folder / "adapter_model.bin"
        raise FileNotFoundError(f"{weights_path}: no such file"
                                + (f" ({old.name} is there: a pickle, which this does not "
                                   "load; in PEFT, load it and save_pretrained(..., "
                                   "safe_serialization=True))" if old.is_file() else ""))
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not JSON: {e}") from None
    _check_peft_config(config, str(config_path))
    if _adapters(model) or _deltas(model):
        raise ValueError("the model already has LoRA adapters: load an adapter onto the base "
                         "model (as PeftModel.from_pretrained takes it)")
    try:
        state = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path} is not a safetensors file: {e}") from None
    targets = _peft_targets(model, config["target_modules"], config.get("exclude_modules"))
    if not targets:
        raise ValueError(f"{config_path}: target_modules {json.dumps(config['target_modules'])} "
                         "picks no nn.Linear of this model: is it the adapter's base model?")
    weights = {}
    for key, tensor in state.items():
        found = re.fullmatch(re.escape(_PREFIX) + r"(.+)\.lora_([AB])\.weight", key)
        if not found:
            raise ValueError(f"{weights_path}: tensor {key!r} is not a LoRA A or B weight of an "
                             f"nn.Linear as PEFT names them ({_PREFIX}<layer>.lora_A.weight): "
                             "embedding adapters, DoRA magnitudes, biases and saved modules do "
                             "not load here")
        weights[(found[1], found[2])] = tensor
    named = {layer for layer, _ in weights}
    missing = [t for t in targets if (t, "A") not in weights or (t, "B") not in weights]
    extra = sorted(named - set(targets))
    if missing or extra:
        raise ValueError(f"{weights_path} does not match what target_modules picks in this "
                         "model: " + "; ".join(
                             ([f"no weights for {', '.join(missing[:4])}"] if missing else [])
                             + ([f"weights for {', '.join(extra[:4])}, which it does not pick"]
                                if extra else [])))
    r = config["r"]
    for name in targets:
        out_f, in_f = model.get_submodule(name).weight.shape
        for part, shape in (("A", (r, in_f)), ("B", (out_f, r))):
            if tuple(weights[name, part].shape) != shape:
                raise ValueError(f"{weights_path}: {name}.lora_{part} is "
                                 f"{tuple(weights[name, part].shape)}, this model's layer needs "
                                 f"{shape} (r = {r})")
    apply_lora(model, r, targets, alpha=float(config["lora_alpha"]))
    with torch.no_grad():
        for name in targets:
            layer = model.get_submodule(name)
            layer.A.copy_(weights[name, "A"])
            layer.B.copy_(weights[name, "B"])
    dropout = config.get("lora_dropout") or 0.0
    if dropout:
        warnings.warn(f"{config_path}: lora_dropout {dropout} is not applied here (no dropout "
                      "on the adapter's input): outputs in eval mode are PEFT's, a training "
                      "step differs", stacklevel=2)
    return model
