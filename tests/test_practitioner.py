"""The companion on models the course does not ship (examples/models.py): a language model on
nn.MultiheadAttention, Llama-style blocks, a CNN with BatchNorm. `track` counts a model built
before it (as torch's MemTracker.track_external does, to the byte), buffers apart, and per module;
LoRA adapts nn.MultiheadAttention correctly and warns about what it froze; the batch finder
says when nothing caps memory."""
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from companion import lora
from companion.accumulation import find_max_batch_size
from companion.memory import memory_budget, track
from examples import models as M

pytestmark = pytest.mark.filterwarnings("ignore:apply_lora froze")


def _lm_step(model, opt, batch=8):
    x = torch.randint(model.vocab, (batch, model.seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(x)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _cnn_step(model, opt, batch=16):
    torch.manual_seed(0)
    M.cnn_step(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


CASES = {"mha_lm": (M.mha_lm, torch.optim.AdamW, _lm_step),
         "llama": (M.llama, torch.optim.AdamW, _lm_step),
         "cnn": (M.cnn, M.cnn_optimizer, _cnn_step)}


@pytest.mark.parametrize("name", CASES)
def test_track_external_counts_a_model_built_before_it_as_memtracker_does(name):
    from torch.distributed._tools.mem_tracker import MemTracker
    make, make_opt, step = CASES[name]
    torch.manual_seed(0)
    model = make()
    opt = make_opt(model.parameters())
    step(model, opt)                                        # optimizer state exists now
    with track("cpu") as blind:
        step(model, opt)
    with track("cpu", external=(model, opt)) as t:
        step(model, opt)
    states = t.breakdown("current")
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert states["parameters"] == params and states["buffers"] == buffers
    assert states["optimizer_state"] >= params // (2 if name == "cnn" else 1)
    assert t.peak == blind.peak + params + buffers + states["optimizer_state"]
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step(model, opt)
    assert t.peak == tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_measure_takes_a_device_and_external_states():
    from companion.memory import measure
    model = M.cnn()
    report = measure(lambda: model(torch.randn(2, 3, 32, 32)).sum().backward(), device="cpu",
                     external=model)
    assert report.device.type == "cpu"
    assert report.breakdown("current")["parameters"] == sum(p.numel() * 4
                                                             for p in model.parameters())


def test_track_external_rejects_what_is_not_a_model_or_optimizer():
    with pytest.raises(TypeError, match="external= takes a model"):
        with track("cpu", external=[torch.zeros(3)]):
            pass


def test_batchnorm_statistics_are_buffers_not_parameters():
    model = M.cnn()
    with track("cpu") as t:
        model(torch.randn(4, 3, 32, 32)).sum().backward()
    running = sum(b.numel() * b.element_size() for b in model.buffers())
    parts = t.breakdown("current")
    assert parts["buffers"] == 0 and parts["gradients"] > 0      # made before: not counted
    with track("cpu", external=model) as t:
        model(torch.randn(4, 3, 32, 32)).sum().backward()
    assert t.breakdown("current")["buffers"] == running > 0


def test_per_module_view_attributes_the_peak_and_orders_the_phases():
    torch.manual_seed(0)
    model = M.llama()
    opt = torch.optim.AdamW(model.parameters())
    with track("cpu", external=(model, opt), modules=model) as t:
        _lm_step(model, opt)
    rows = t.modules()
    assert set(rows) >= {"(model)", "layers.0", "layers.3.down", "head"}
    for i in range(4):
        row = rows[f"layers.{i}"]
        assert row["forward_before"] < row["forward_after"]           # saves for backward
        assert row["at_peak"] > 0
        assert row["backward_before"] is not None and row["backward_after"] is not None
    # forward runs layer 0 first; backward reaches layer 3 first
    assert rows["layers.0"]["forward_before"] < rows["layers.3"]["forward_before"]
    assert rows["layers.3"]["at_peak"] >= rows["layers.3.down"]["at_peak"]
    blocks = sum(rows[f"layers.{i}"]["at_peak"] for i in range(4))
    assert blocks <= t.breakdown()["activations"] + t.breakdown()["temporaries"]
    with track("cpu") as plain:
        pass
    with pytest.raises(ValueError, match="modules=model"):
        plain.modules()


def test_lora_adapts_multihead_attention_as_its_merged_weights_would():
    torch.manual_seed(0)
    model = M.mha_lm()
    merged = copy.deepcopy(model)
    lora.apply_lora(model, 4)
    with torch.no_grad():                                   # a trained adapter: B no longer 0
        for m in model.modules():
            if isinstance(m, (lora.LoRALinear, lora.LowRankDelta)):
                m.B.normal_(0, 0.02)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("in_proj_weight" in n for n in trainable) and any("out_proj" in n for n in trainable)
    assert all(n.endswith((".A", ".B")) for n in trainable)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, lora.LoRALinear):
                merged.get_submodule(name).weight.copy_(m.merged_weight())
            if isinstance(m, nn.MultiheadAttention):              # W + s·B·A, formed here
                ref = merged.get_submodule(name)
                ref.in_proj_weight.copy_(m.in_proj_weight)
                ref.out_proj.weight.copy_(m.out_proj.weight)
                assert not torch.equal(ref.in_proj_weight, m.parametrizations.in_proj_weight
                                       .original)
    x = torch.randint(512, (2, 64))
    torch.testing.assert_close(model(x), merged(x), rtol=1e-5, atol=1e-5)
    model(x).square().mean().backward()                     # the adapters get gradients
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    delta = model.layers[0].self_attn.parametrizations.in_proj_weight[0]
    assert delta.B.grad.abs().sum() > 0 and delta.A.grad.abs().sum() > 0


def test_lora_warns_naming_the_layers_it_froze_without_an_adapter():
    with pytest.warns(UserWarning, match=r"froze 3 layer\(s\).*Conv2d"):
        lora.apply_lora(M.cnn(), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # transformers: nothing left out
        lora.apply_lora(M.llama(), 2)
        lora.apply_lora(M.mha_lm(), 2)


def test_lora_targets_name_attention_too():
    model = lora.apply_lora(M.mha_lm(), 2, targets=["self_attn"])
    assert lora.trainable_params(model) == 4 * 2 * (2 * 128 + (128 + 3 * 128))
    with pytest.raises(ValueError, match="no nn.Linear named 'attn'.*MultiheadAttention self_attn"):
        lora.apply_lora(M.mha_lm(), 2, targets=["attn"])


def test_find_max_batch_size_warns_on_a_cpu_outside_a_budget():
    with pytest.warns(UserWarning, match="outside memory_budget") as caught:
        assert find_max_batch_size(lambda b: None, device="cpu", limit=64) == 64
    assert any("stopped at limit=64" in str(w.message) for w in caught)
    model = M.cnn()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with memory_budget("24 MiB"):
            largest = find_max_batch_size(lambda b: M.cnn_step(model, b).backward(),
                                          device="cpu", limit=4096)
    assert 1 <= largest < 4096


def test_find_max_batch_size_frees_what_a_failed_try_left_in_a_reference_cycle():
    """A failed try whose tensors sit in a cycle (as frames held by a traceback do) would make
    every later try fail if they stayed counted: the search collects them when the budget still
    counts the try's bytes."""
    import gc
    gc.disable()                                  # only find_max_batch_size may collect here
    try:
        with memory_budget("1 MiB"):
            def step(b):
                held = [torch.empty(b * 256)]     # b KiB in a cycle, as a traceback's frames
                held.append(held)
                torch.empty(b * 512)              # 2b KiB more: 3b KiB fit up to b = 341
                held.clear()                      # a try that ran leaves no cycle
            assert find_max_batch_size(step, device="cpu", limit=4096) == 341
    finally:
        gc.enable()
