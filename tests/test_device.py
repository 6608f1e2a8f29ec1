"""companion.device: the device picked, the machine described, and sizes that fit."""
import torch

from companion import estimate as E
from companion.device import Sizes, _SIZES, describe, pick_device, sizes


def test_pick_device_and_sizes_follow_the_device():
    assert pick_device("cpu") == torch.device("cpu")
    assert sizes("cpu") is _SIZES["cpu"] and sizes("cuda") is _SIZES["cuda"]
    assert isinstance(sizes(), Sizes)
    info = describe("cpu")
    assert info["device"] == "cpu" and info["threads"] >= 1


def test_chapter_00_gpt_step_fits_an_80_gb_gpu_at_60_percent():
    """Chapter 00 trains the course GPT at GPU sizes with fp32 Adam; its peak is the model states,
    the activations and, early in backward, the fp32 gradient of the logits."""
    s = _SIZES["cuda"]
    n = E.gpt_params(s.vocab, s.seq_len, s.gpt_width, s.gpt_depth)
    shape = {"width": s.gpt_width, "depth": s.gpt_depth, "heads": s.gpt_heads, "vocab": s.vocab}
    parts = E.training_memory(n, batch=s.anatomy_gpt_batch, seq_len=s.seq_len, shape=shape)
    logits_grad = 4 * s.anatomy_gpt_batch * s.seq_len * s.vocab
    assert sum(parts.values()) + logits_grad <= 0.6 * 80e9
    mlp = E.mlp_params(s.width, s.width, s.depth, 10)
    assert E.model_states(mlp).total + E.mlp_activations(s.batch, s.width, s.depth, 10) \
        <= 0.6 * 80e9
