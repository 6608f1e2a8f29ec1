"""Where model states go under offload: device, host and disk bytes, before running anything.

Two conventions. `convention="deepspeed"` reproduces DeepSpeed's memory estimators exactly,
`estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py) and
`estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py), as in DeepSpeed
0.19.8 and documented on https://deepspeed.readthedocs.io/en/latest/memory.html. Per parameter P,
with N = gpus_per_node x nodes GPUs, L = largest_layer_params, b = buffer_factor (default 1.5):

    ZeRO-2, optimizer on CPU:       device 2P                   host P max(4N, 16) b
    ZeRO-2, no offload:             device 2P + int(18P/N)      host 4P gpus_per_node b
    ZeRO-3, optimizer+params CPU:   device 4L                   host 18P/nodes b (zero_init)
    ZeRO-3, optimizer on CPU:       device 4L + int(2P/N)       host 16P/nodes b (zero_init)
    ZeRO-3, no offload:             device 4L + int(18P/N)      host 4L gpus_per_node b (zero_init)
    (without zero_init the ZeRO-3 host figures are P max(4 gpus_per_node, 18 or 16 /nodes) b and
    4P gpus_per_node b.)

They assume fp16 weights (2 bytes) and Adam (fp32 master 4 + gradients 4 + moments 8 = 16 on the
host); "host" is per node, b is a safety margin, 4L is the largest layer gathered (fp16 weights and
gradients) at ZeRO-3, and the host's 4P·gpus_per_node is the fp32 model that each process loads
before it moves to the GPUs. DeepSpeed's docs still print the older ZeRO-2 no-offload figure
(4P + 16P/N); the code has used 2P + 18P/N since 2024 (PR #5099), which is what we reproduce.

`convention="course"` is the layout this course's `CPUOffloadOptimizer` and `NVMeOffloadOptimizer`
allocate, on one device, measured to the byte in chapter 08 (no safety margin):
device `param_bytes`·P (the weights); host 4P master + 4P gradients + 8P moments (+ param_bytes·P
for the 16-bit copy sent up when the weights are 16-bit); with "nvme", master and moments (12P)
move to disk and the host keeps the gradients (and the 16-bit copy). Both count AdamW's 4-byte step
counter per parameter tensor as nothing.

Example:
    >>> offload_placement(7_000_000_000, zero_stage=2, offload_optimizer="cpu")
    Placement(device=14000000000, host=168000000000, disk=0, convention='deepspeed')
"""
from __future__ import annotations

import dataclasses
import math
import numbers

__all__ = ["Placement", "offload_placement", "OFFLOAD_LADDER", "choose_offload", "rung_placement"]

_WHERE = (None, "cpu", "nvme")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Bytes of model states per GPU (`device`), per node in host RAM (`host`), and on disk."""

    device: int
    host: int
    disk: int = 0
    convention: str = "deepspeed"


def offload_placement(n_params: int, *, zero_stage: int, offload_optimizer: str | None = None,
                      offload_params: str | None = None, gpus_per_node: int = 1, nodes: int = 1,
                      largest_layer_params: int = 0, zero_init: bool = True,
                      buffer_factor: float = 1.5, convention: str = "deepspeed",
                      param_bytes: int = 2) -> Placement:
    """Device, host and disk bytes of model states for `n_params` trained with Adam, with the
    optimizer state (and at ZeRO-3 the parameters) offloaded to "cpu" or "nvme" or kept (None).

    See the module docstring for the formulas of each convention. `param_bytes` (4 or 2) is the
    device weights' size for convention="course"; DeepSpeed's convention assumes 2.
    """
    n_params = _check_count("n_params", n_params)
    largest_layer_params = _check_count("largest_layer_params", largest_layer_params)
    gpus_per_node = _check_count("gpus_per_node", gpus_per_node, minimum=1)
    nodes = _check_count("nodes", nodes, minimum=1)
    for name, value in (("offload_optimizer", offload_optimizer),
                        ("offload_params", offload_params)):
        if value not in _WHERE:
            raise ValueError(f'{name} must be None, "cpu" or "nvme"; got {value!r}')
    if not isinstance(buffer_factor, numbers.Real) or isinstance(buffer_factor, bool) or not (
            buffer_factor >= 1):
        raise ValueError(f"buffer_factor must be a number >= 1, got {buffer_factor!r}")
    buffer_factor = float(buffer_factor)                # a NumPy float32 would round the bytes
    if not isinstance(zero_init, bool):
        raise ValueError(f"zero_init must be True or False, got {zero_init!r}")
    if convention == "deepspeed":
        return _deepspeed(n_params, zero_stage, offload_optimizer, offload_params, gpus_per_node,
                          nodes, largest_layer_params, zero_init, buffer_factor)
    if convention == "course":
        return _course(n_params, zero_stage, offload_optimizer, offload_params,
                       gpus_per_node * nodes, param_bytes)
    raise ValueError(f'convention must be "deepspeed" or "course", got {convention!r}')


def _deepspeed(P, stage, opt, params, per_node, nodes, L, zero_init, b) -> Placement:
    if "nvme" in (opt, params):
        raise ValueError('DeepSpeed\'s estimators have no NVMe case (they take cpu_offload flags '
                         'only): use "cpu" for the device side, which does not depend on where '
                         'the offloaded states live, or convention="course" for the NVMe tier')
    if stage not in (2, 3):
        raise ValueError(f"DeepSpeed publishes estimators for ZeRO stages 2 and 3 only; got "
                         f"zero_stage={stage!r}")
    N = per_node * nodes
    if stage == 2:
        if params is not None:
            raise ValueError("ZeRO-2 keeps every parameter on the GPU: offload_params needs "
                             "zero_stage=3")
        if opt == "cpu":                               # estimate_zero2_model_states_mem_needs
            return Placement(int(2 * P), int(P * max(4 * N, 16) * b))
        return Placement(int(2 * P + int(18 * P / N)), int(P * 4 * per_node * b))
    if params == "cpu" and opt is None:
        raise ValueError("DeepSpeed offloads the parameters only together with the optimizer "
                         'state: pass offload_optimizer="cpu" too')
    largest, factor = 4 * L, 1 / nodes                 # estimate_zero3_model_states_mem_needs
    if opt == "cpu":
        per_param = 18 if params == "cpu" else 16
        device = largest if params == "cpu" else largest + int(2 * P / N)
        host = (P * per_param * factor * b if zero_init
                else P * max(4 * per_node, per_param * factor) * b)
        return Placement(int(device), int(host))
    host = L * 4 * per_node * b if zero_init else P * 4 * per_node * b
    return Placement(int(largest + int(18 * P / N)), int(host))


def _course(P, stage, opt, params, world, param_bytes) -> Placement:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {stage!r}")
    if world != 1:
        raise ValueError("the course's layout is measured on one device (gpus_per_node=1, "
                         'nodes=1); use convention="deepspeed" for several')
    if params is not None:
        raise ValueError("the course offloads optimizer state, not parameters: use "
                         'offload_params=None, or convention="deepspeed" for ZeRO-3 parameter '
                         "offload")
    if (isinstance(param_bytes, bool) or not isinstance(param_bytes, numbers.Integral)
            or param_bytes not in (2, 4)):
        raise ValueError(f"param_bytes must be 4 (fp32 weights) or 2 (16-bit), got {param_bytes!r}")
    param_bytes = int(param_bytes)
    weights, copy_up = param_bytes * P, (param_bytes * P if param_bytes == 2 else 0)
    master, grads, moments = 4 * P, 4 * P, 8 * P
    if opt is None:                                    # everything on the device
        fp32_master = master if param_bytes == 2 else 0
        return Placement(weights + param_bytes * P + fp32_master + moments, 0, 0, "course")
    if opt == "cpu":
        return Placement(weights, master + grads + moments + copy_up, 0, "course")
    return Placement(weights, grads + copy_up, master + moments, "course")


# Fastest first: Hugging Face Transformers' DeepSpeed guide, "How to Choose Which ZeRO Stage and
# Offloads To Use For Best Performance": Stage 2 > Stage 2 + offload > Stage 3 > Stage 3 + offloads.
OFFLOAD_LADDER = (
    {"zero_stage": 2, "offload_optimizer": None, "offload_params": None},
    {"zero_stage": 2, "offload_optimizer": "cpu", "offload_params": None},
    {"zero_stage": 3, "offload_optimizer": None, "offload_params": None},
    {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": None},
    {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
)


def choose_offload(n_params: int, *, device_budget: int | str, host_budget: int | str,
                   gpus_per_node: int = 1, largest_layer_params: int = 0) -> dict | None:
    """The first setting of `OFFLOAD_LADDER` (fastest first) whose DeepSpeed placement fits both
    the GPU's `device_budget` and the node's `host_budget` (bytes, or a size such as "80 GB"),
    or None if none does. Each rung is tested: down the ladder each one is slower, and the device
    bytes usually fall, not always (ZeRO-3's 4L + 18P/N can exceed ZeRO-2 + offload's 2P).

        >>> choose_offload(7 * 10**9, device_budget="24 GB", host_budget="1 TB", gpus_per_node=8)
        {'zero_stage': 2, 'offload_optimizer': 'cpu', 'offload_params': None}

    Simplified vs DeepSpeed: DeepSpeed has no such chooser; the order is Hugging Face's guide's,
    and only model states are counted (leave room for activations)."""
    device_budget, host_budget = _budget(device_budget), _budget(host_budget)
    for setting in OFFLOAD_LADDER:
        placed = offload_placement(n_params, **setting, gpus_per_node=gpus_per_node,
                                   largest_layer_params=largest_layer_params)
        if placed.device <= device_budget and placed.host <= host_budget:
            return dict(setting)
    return None


def rung_placement(n_params: int, rung: str, *, weight_bytes: int = 2,
                   largest_layer_params: int = 0) -> Placement:
    """Bytes of model states on one device, its host and its disk on each rung of the offload
    ladder (`companion.cost.OFFLOAD_RUNGS`, timed by `companion.cost.offload_ladder`), for AdamW
    with `weight_bytes` (2: 16-bit weights and gradients, fp32 masters; 4: fp32 throughout):

        rung         device                        host                            disk
        none         (w + w + 4·[w=2] + 8)P        0                               0
        optimizer    (w + w)P: weights, gradients  (16 + w·[w=2])P                 0
        gradients    w·P: the weights              (16 + w·[w=2])P                 0
        parameters   2·2w·L: a layer and the next  (16 + 2w·[w=2])P                0
        nvme         2·2w·L                        (4 + 2w·[w=2] + 4·[w=4])P       12P

    The host of the first offloaded rungs is the course's `CPUOffloadOptimizer` to the byte
    (fp32 master 4, fp32 gradient 4, moments 8, and for 16-bit weights the 16-bit buffer the
    gradients land in and the weights leave from). With the parameters on the host, the 16-bit
    weights need their own copy beside that buffer (in fp32 the masters are the weights); on
    "nvme" the masters and moments move to disk, and the host keeps the gradients and a copy of
    the weights to fetch from. L is the largest layer's parameter
    count: with the parameters offloaded, the device holds the layer computing and the one
    being prefetched, weights and gradients."""
    n_params = _check_count("n_params", n_params)
    L = _check_count("largest_layer_params", largest_layer_params)
    if isinstance(weight_bytes, bool) or weight_bytes not in (2, 4):
        raise ValueError(f"weight_bytes must be 2 (16-bit) or 4 (fp32), got {weight_bytes!r}")
    from companion.cost.step import OFFLOAD_RUNGS      # the cost model owns the ladder's names
    if rung not in OFFLOAD_RUNGS:
        raise ValueError(f"rung must be one of {OFFLOAD_RUNGS}, got {rung!r}")
    P, w = n_params, weight_bytes
    half = w == 2
    if rung == "none":
        return Placement((2 * w + 4 * half + 8) * P, 0, 0, "course")
    if rung in ("optimizer", "gradients"):
        device = 2 * w * P if rung == "optimizer" else w * P
        return Placement(device, (16 + w * half) * P, 0, "course")
    layers = 2 * 2 * w * L
    if rung == "parameters":                           # fp32: the masters are the weights
        return Placement(layers, (16 + 2 * w * half) * P, 0, "course")
    return Placement(layers, (4 + (2 * w if half else 4)) * P, 12 * P, "course")


def _budget(value) -> int:
    """Bytes from an int or a string such as "80 GB" (`companion.memory.parse_bytes`)."""
    from companion.memory import parse_bytes       # here: memory imports at module level
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a budget must be a finite number of bytes or a size like '80 GB', "
                         f"got {value!r}")
    return parse_bytes(value)


def _check_count(name: str, value, *, minimum: int = 0) -> int:
    """`value` as a Python int (NumPy's integers too), or a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)
