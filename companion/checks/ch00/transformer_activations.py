"""Chapter 00, exercise 4: the activation bytes of any transformer block, predicted."""
from __future__ import annotations

import random

from companion import estimate
from companion.checks.ch00._common import _number
from companion.checks.core import call, compare, exercise, fresh_seeds

__all__ = ["check_transformer_activations"]


_GPT2 = {"GPT-2 small": (768, 12, 12), "GPT-2 XL": (1600, 48, 25)}   # width, depth, heads


def _transformer_mistakes(b: int, s: int, h: int, L: int, a: int, V: int,
                          dropout: bool) -> dict[str, int]:
    right = estimate.transformer_activations(b, s, h, L, a, V, dropout=dropout)
    layer = estimate.transformer_layer_activations(b, s, h, a, dropout=dropout)
    quadratic = (5 if dropout else 2) * a * s * s * b
    outside = right - L * layer
    paper_layers = L * estimate.transformer_layer_activations(b, s, h, a, dropout=True)
    without = ("without dropout three tensors go: the two sbh masks and, in attention, the as²b "
               "mask and dropout's 2as²b output (the product with V saves softmax's output, "
               "already counted)")
    return {
        without: estimate.transformer_activations(b, s, h, L, a, V, dropout=True),
        without + ".": paper_layers + outside,
        "attention saves (heads × s × s) scores per sequence: the 5as²b (2as²b without dropout) "
        "term that grows with the square of the sequence": right - L * quadratic,
        "the attention terms are per head: a·s²·b, not s²·b":
            right - L * quadratic + L * quadratic // a,
        "the loss keeps the log-softmax of the logits, b·s·vocab values in fp32 (4 bytes)":
            right - 4 * s * b * V,
        "the log-softmax is fp32 (4 bytes per value), not 16-bit": right - 2 * s * b * V,
        "every one of the `depth` layers saves its own activations": layer + outside,
        "outside the layers: the final LayerNorm's input and the head's input (2sbh each), and "
        "with dropout the embedding dropout's mask (sbh)": L * layer + 4 * s * b * V,
        "outside the layers, the final LayerNorm's input and the head's input (2sbh each) are "
        "kept too": right - 4 * s * b * h,
        "outside the layers two inputs of 2sbh are kept, the final LayerNorm's and the head's: "
        "one is missing": right - 2 * s * b * h,
        "with dropout, the embeddings' dropout keeps its mask too, outside the layers: sbh bytes "
        "(1 per value)": right - s * b * h if dropout else right,
        "without dropout the product with V saves softmax's output itself, already counted: "
        "2as²b per layer, not 2as²b twice": right if dropout else right + L * 2 * a * s * s * b,
    }


def _coinciding(case: tuple[int, ...], dropout: bool) -> set[tuple[str, str]]:
    mistakes = _transformer_mistakes(*case, dropout)
    return {(one, other) for one in mistakes for other in mistakes
            if one < other and mistakes[one] == mistakes[other]}


def _telling_case(rng: random.Random, heads: int) -> tuple[int, int, int, int, int, int]:
    """A random case in which the known mistakes give different numbers wherever they do in
    general: 2 layers of one head over 28 tokens at width 56 make the s² terms equal the sbh terms
    outside the layers, and the hint would name the wrong one. (Some mistakes are one mistake
    twice over, equal in every case: those stay.)"""
    generic = (7, 101, 8 * heads * 11, 5, heads, 4099)
    while True:
        case = (rng.randint(1, 9), rng.randint(16, 300), 8 * heads * rng.randint(1, 12),
                rng.randint(1, 6), heads, rng.randint(50, 5000))
        if all(_coinciding(case, d) <= _coinciding(generic, d) for d in (True, False)):
            return case


@exercise(points=2, reference=("companion.estimate.transformer_activations",
                               "companion.estimate.transformer_layer_activations"))
def check_transformer_activations(answer) -> str:
    """answer(batch, seq_len, width, depth, heads, vocab, dropout) -> bytes a GPT with 16-bit
    activations saves for backward, Korthikanti et al.'s count plus the head and the loss."""
    rng = random.Random(fresh_seeds(1)[0])
    cases = [_telling_case(rng, heads) for heads in (1, 3, 4, 7)]
    cases += [(8, 1024, h, L, a, 50257) for h, L, a in _GPT2.values()]
    for b, s, h, L, a, V in cases:
        for dropout in (True, False):
            expected = estimate.transformer_activations(b, s, h, L, a, V, dropout=dropout)
            wrong = {hint: v for hint, v in _transformer_mistakes(b, s, h, L, a, V,
                                                                         dropout).items()
                     if v != expected}
            got = _number(call(answer, b, s, h, L, a, V, dropout), "activation bytes")
            compare(got, expected, name=f"batch {b}, seq_len {s}, width {h}, depth {L}, "
                    f"heads {a}, vocab {V}, dropout={dropout}", rtol=0.0, atol=0.5,
                    known_wrong=wrong)
    width, depth, heads = _GPT2["GPT-2 XL"]
    plain, dropped = (estimate.transformer_activations(8, 1024, width, depth, heads, 50257,
                                                       dropout=d) for d in (False, True))
    n = estimate.gpt_params(50257, 1024, width, depth)            # the head not tied: 1.64B
    states = estimate.model_states(n, precision="mixed").total
    return (f"GPT-2 XL, batch 8 × 1024 tokens, 16-bit, {n / 1e9:.2f}B parameters: "
            f"{states / 1e9:.1f} GB of model states (16-bit + fp32 master, Adam); without "
            f"dropout, this chapter's convention, {plain / 1e9:.1f} GB of activations, "
            f"{(plain + states) / 1e9:.0f} GB in all, under 80 GB with "
            f"{80 - (plain + states) / 1e9:.0f} GB for temporaries; with dropout, "
            f"{dropped / 1e9:.1f} GB of activations, {(dropped + states) / 1e9:.0f} GB: more than "
            "an 80 GB GPU holds")
