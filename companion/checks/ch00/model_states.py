"""Chapter 00, exercise 2: the bytes of weights, gradients and optimizer state, per layout."""
from __future__ import annotations

import random

from companion import estimate
from companion.checks.ch00._common import _number
from companion.checks.core import call, compare, exercise, fresh_seeds, require

__all__ = ["check_model_state_bytes"]


LAYOUTS = {"fp32": ("fp32", {}), "autocast": ("autocast", {}), "master": ("mixed", {}),
           "master_fp32_grads": ("mixed", {"fp32_grads": True}),
           "master_grad_buffer": ("mixed", {"fp32_grad_buffer": True})}


def _state_reference(n: int, optimizer: str, layout: str) -> tuple[int, int, int]:
    precision, options = LAYOUTS[layout]
    s = estimate.model_states(n, optimizer=optimizer, precision=precision, **options)
    return s.params, s.grads, s.optimizer


_MASTER_GRADS = {"master": 2, "master_fp32_grads": 4, "master_grad_buffer": 2 + 4}   # B/param


def _state_mistakes(n: int, k: int, layout: str) -> dict[str, tuple]:
    """What the usual mistakes give, for a layout and k state tensors per parameter."""
    master = layout.startswith("master")
    return {
        "the 16-bit model's optimizer steps an fp32 master copy of the weights: 4 bytes per "
        "parameter, counted in the optimizer state (ZeRO's K).": (2 * n, 2 * n, 4 * k * n)
        if layout == "master" else None,
        "16-bit weights do not make 16-bit optimizer state: the master weights and the moments "
        "stay fp32.": (2 * n, 2 * n, 2 * k * n) if master else None,
        "torch.amp keeps the parameters and their .grad in fp32: the 16-bit copies autocast "
        "makes are saved for backward, activations, not model states.":
            (2 * n, 2 * n, (4 + 4 * k) * n) if layout == "autocast" else None,
        "fp32 gradients replace the 16-bit ones (4 bytes, not 2 + 4).":
            (2 * n, 6 * n, (4 + 4 * k) * n) if layout == "master_fp32_grads" else None,
        "the fp32 buffer sits beside the 16-bit gradients, it does not replace them: 2 + 4 "
        "bytes.": (2 * n, 4 * n, (4 + 4 * k) * n) if layout == "master_grad_buffer" else None,
        "Adam keeps two tensors per parameter: the mean (m) and the mean of squares (v) of the "
        "gradient.": (4 * n, 4 * n, 4 * n) if layout in ("fp32", "autocast") and k == 2 else None,
        "the same total, split the other way: Hugging Face's pages count the fp32 master copy "
        "with the parameters (2 + 4 = 6 bytes); this exercise follows ZeRO, which counts it in "
        "the optimizer state: params = the 16-bit weights only (2 bytes).":
            (6 * n, _MASTER_GRADS.get(layout, 0) * n, 4 * k * n) if master else None,
        "torch.amp's 16-bit weight copies are made inside each matmul and freed in backward: "
        "they are counted with the activations, so the parameters stay 4 bytes, not 4 + 2.":
            (6 * n, 4 * n, 4 * k * n) if layout == "autocast" else None,
    }


@exercise(points=2, reference="companion.estimate.model_states")
def check_model_state_bytes(answer) -> str:
    """answer(n_params, optimizer, layout) -> (params, grads, optimizer_state) bytes, for
    optimizer in "sgd", "sgd_momentum", "adam" and layout in LAYOUTS."""
    for n in (random.Random(s).randint(10**3, 10**9) for s in fresh_seeds(2)):
        for optimizer, k in (("sgd", 0), ("sgd_momentum", 1), ("adam", 2)):
            for layout in LAYOUTS:
                expected = _state_reference(n, optimizer, layout)
                wrong = {hint: value for hint, value in _state_mistakes(n, k, layout).items()
                         if value is not None and value != expected}
                got = call(answer, n, optimizer, layout)
                require(isinstance(got, (tuple, list)) and len(got) == 3,
                        f"expected a tuple (params, grads, optimizer_state), got {got!r}"[:200],
                        hint="return three byte counts, e.g. `return p, g, o`.")
                got = tuple(_number(x, "a byte count") for x in got)
                compare(got, expected, name=f"(params, grads, optimizer_state) for {optimizer}, "
                        f"{layout}", known_wrong=wrong)
    per = {layout: estimate.model_states(1, precision=p, **o).total
           for layout, (p, o) in LAYOUTS.items()}
    return ("Adam's bytes per parameter: fp32 {fp32}, torch.amp {autocast}, 16-bit + fp32 master "
            "{master}, with fp32 gradients {master_fp32_grads}, with an fp32 gradient buffer "
            "{master_grad_buffer}".format(**per))
