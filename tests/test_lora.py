"""LoRA: the adapter computes W + s·B·A, its gradients are the hand-derived ones, the base stays
frozen, and gradients and optimizer state exist only for the adapters (measured)."""
import json

import pytest
import torch
from torch import nn

from companion import lora, memory, models


def _adapter(in_f=7, out_f=5, rank=3, alpha=None, seed=0):
    torch.manual_seed(seed)
    layer = lora.LoRALinear(nn.Linear(in_f, out_f), rank, alpha=alpha)
    with torch.no_grad():
        layer.B.normal_()                   # a non-zero update, as after some training
    return layer


@pytest.mark.parametrize("alpha", [None, 16.0])
def test_forward_equals_the_merged_weight(alpha):
    layer = _adapter(alpha=alpha)
    x = torch.randn(4, 6, 7)                                              # (..., in)
    merged = nn.functional.linear(x, layer.merged_weight(), layer.base.bias)
    torch.testing.assert_close(layer(x), merged)
    torch.testing.assert_close(layer.merge()(x), merged)
    assert layer.scale == (1.0 if alpha is None else alpha / 3)


def test_a_fresh_adapter_changes_nothing():
    torch.manual_seed(0)
    base = nn.Linear(9, 4)
    x = torch.randn(3, 9)
    expected = base(x)
    assert torch.equal(lora.LoRALinear(base, 2)(x), expected)


def test_gradients_are_the_hand_derived_ones_and_the_base_stays_frozen():
    layer = _adapter(alpha=6.0)
    W, b = layer.base.weight.clone(), layer.base.bias.clone()
    x, G = torch.randn(10, 7), torch.randn(10, 5)          # L = sum(y * G), so dL/dy = G
    (layer(x) * G).sum().backward()
    s, A, B = layer.scale, layer.A.detach(), layer.B.detach()
    torch.testing.assert_close(layer.B.grad, s * G.T @ (x @ A.T))          # (out, r)
    torch.testing.assert_close(layer.A.grad, s * (G @ B).T @ x)            # (r, in)
    assert layer.base.weight.grad is None and layer.base.bias.grad is None
    expected_A = A - 0.1 * layer.A.grad
    torch.optim.SGD([layer.A, layer.B], lr=0.1).step()
    torch.testing.assert_close(layer.A.detach(), expected_A)
    assert torch.equal(layer.base.weight, W) and torch.equal(layer.base.bias, b)


def _gpt():
    return models.GPT(vocab=31, seq_len=12, width=16, depth=2, heads=2, seed=0)


def test_apply_lora_adapts_every_linear_by_default_and_freezes_the_rest():
    model = lora.apply_lora(_gpt(), rank=2)
    adapters = [m for m in model.modules() if isinstance(m, lora.LoRALinear)]
    assert len(adapters) == 2 * 4 + 1                        # qkv, proj, fc, out per block; head
    expected = sum(lora.lora_params(a.base.in_features, a.base.out_features, 2) for a in adapters)
    assert lora.trainable_params(model) == expected
    assert {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad} == {"A", "B"}


@pytest.mark.parametrize("targets, count", [(["qkv"], 2), (["blocks.1.fc", "head"], 2),
                                            ([nn.Linear], 9)])
def test_apply_lora_targets_by_name_or_type(targets, count):
    model = lora.apply_lora(_gpt(), rank=2, targets=targets)
    assert sum(isinstance(m, lora.LoRALinear) for m in model.modules()) == count


def test_a_trained_adapter_merges_into_a_model_that_computes_the_same():
    model = lora.apply_lora(_gpt(), rank=2, targets=["qkv", "fc"])
    x, y = models.make_tokens(4, 12, vocab=31, seed=1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = model.loss(x, y).item()
    for _ in range(20):
        opt.zero_grad()
        model.loss(x, y).backward()
        opt.step()
    assert model.loss(x, y).item() < first                   # the adapters learn
    with torch.no_grad():
        expected = model(x)
        for name, module in list(model.named_modules()):
            if isinstance(module, lora.LoRALinear):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, module.merge())
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make, error, match", [
    (lambda: lora.LoRALinear(nn.Linear(4, 3), 0), ValueError, "from 1 to min"),
    (lambda: lora.LoRALinear(nn.Linear(4, 3), 4), ValueError, "min\\(in, out\\) = 3"),
    (lambda: lora.LoRALinear(nn.Linear(4, 3), 2.0), ValueError, "rank must be an int"),
    (lambda: lora.LoRALinear(nn.Conv1d(4, 3, 1), 2), TypeError, "adapts an nn.Linear"),
    (lambda: lora.apply_lora(_gpt(), 2, targets=["qvk"]), ValueError, "called fc, head, out"),
    (lambda: lora.apply_lora(nn.Sequential(nn.ReLU()), 2), ValueError, "no nn.Linear"),
])
def test_bad_arguments_say_what_to_do(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_measured_gradients_and_adam_state_exist_only_for_the_adapters():
    model = lora.apply_lora(_gpt(), rank=2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = lora.trainable_params(model)
    opt = torch.optim.Adam(trainable, lr=1e-3)
    x, y = models.make_tokens(4, 12, vocab=31, seed=1)
    with memory.track("cpu") as t:
        model.loss(x, y).backward()
        opt.step()
    kinds = t.breakdown("current")
    assert kinds["gradients"] == 4 * n                       # fp32 gradients of A and B only
    # Adam: m and v (8 bytes per trainable parameter) and one fp32 step counter per tensor
    assert kinds["optimizer_state"] == 8 * n + 4 * len(trainable)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert frozen > 5 * n                                    # what full fine-tuning would add


# ---------------------------------------------------------------- the contract of PEFT's LoRA
# Hugging Face PEFT (a test-only dependency; it runs on a CPU) and ours on the same model.

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k = nn.Linear(8, 12), nn.Linear(12, 6, bias=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.k(torch.relu(self.q(x)))))


@pytest.fixture(scope="module")
def peft_pair():
    """(PEFT's model, ours) on one _Net, adapters q and k at rank 4, alpha 8, with PEFT's
    adapter weights (B made non-zero, as after training) copied into ours."""
    peft = pytest.importorskip("peft")

    def make():
        theirs = peft.get_peft_model(_Net(), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q", "k"], lora_dropout=0.0))
        ours = lora.apply_lora(_Net(), 4, ["q", "k"], alpha=8)
        torch.manual_seed(1)
        for name in ("q", "k"):
            layer = theirs.base_model.model.get_submodule(name)
            with torch.no_grad():
                layer.lora_B["default"].weight.normal_()
                getattr(ours, name).A.copy_(layer.lora_A["default"].weight)
                getattr(ours, name).B.copy_(layer.lora_B["default"].weight)
        return theirs, ours
    return make


def test_same_trainable_parameters_as_peft(peft_pair):
    theirs, ours = peft_pair()
    shapes = lambda m: sorted(tuple(p.shape) for p in m.parameters() if p.requires_grad)
    assert shapes(theirs) == shapes(ours) and len(shapes(ours)) == 4     # A and B of q and k
    assert lora.trainable_params(ours) == sum(p.numel() for p in theirs.parameters()
                                              if p.requires_grad)
    assert ours.q.scale == theirs.base_model.model.q.scaling["default"] == 8 / 4


def test_same_outputs_gradients_and_training_as_peft(peft_pair):
    theirs, ours = peft_pair()
    x, y = torch.randn(10, 8), torch.randn(10, 3)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                  for m in (theirs, ours)]
    for _ in range(5):
        for model, opt in zip((theirs, ours), optimizers):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    for name in ("q", "k"):
        layer = theirs.base_model.model.get_submodule(name)
        torch.testing.assert_close(getattr(ours, name).A, layer.lora_A["default"].weight,
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(getattr(ours, name).B, layer.lora_B["default"].weight,
                                   rtol=1e-5, atol=1e-6)


def test_merging_gives_peft_merge_and_unloads_weights(peft_pair):
    theirs, ours = peft_pair()
    x = torch.randn(4, 8)
    merged = theirs.merge_and_unload()
    for name in ("q", "k"):
        ours_merged = getattr(ours, name).merge()
        theirs_merged = merged.get_submodule(name)
        assert type(theirs_merged) is type(ours_merged) is nn.Linear
        torch.testing.assert_close(ours_merged.weight, theirs_merged.weight, rtol=1e-6, atol=1e-6)
        setattr(ours, name, ours_merged)
    torch.testing.assert_close(ours(x), merged(x), rtol=1e-6, atol=1e-6)


def test_a_fresh_adapter_starts_at_the_base_model_as_peft_does():
    peft = pytest.importorskip("peft")
    x = torch.randn(5, 8)
    base = _Net()(x)
    theirs = peft.get_peft_model(_Net(), peft.LoraConfig(r=2, target_modules=["q"]))
    ours = lora.apply_lora(_Net(), 2, ["q"])
    assert torch.equal(ours(x), base) and torch.equal(theirs(x), base)
    assert theirs.base_model.model.q.scaling["default"] == 8 / 2 and ours.q.scale == 1.0


# --------------------------------------- the whole model and PEFT's files, on a transformers Llama

_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama():
    """A tiny transformers LlamaForCausalLM (GQA: 4 heads, 2 key/value heads), the same weights
    at every call."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _trained(model, seed=1):
    """B made non-zero (as after training), so that the adapters change the outputs."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dim() == 2 and not p.any():
                p.normal_(0, 0.05)
    return model


_IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


def _logits(model):
    with torch.no_grad():
        return model(_IDS).logits


def test_an_adapter_saved_here_loads_in_peft_with_the_same_outputs(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    ours = _trained(lora.apply_lora(_llama(), 4, _TARGETS, alpha=8))
    lora.save_adapter(ours, tmp_path / "ours")
    theirs = peft.PeftModel.from_pretrained(_llama(), tmp_path / "ours").eval()
    assert _logits(ours).sub(_logits(_llama())).abs().max() > 1e-3      # the adapter matters
    torch.testing.assert_close(_logits(theirs), _logits(ours), rtol=1e-5, atol=1e-5)
    # the same files PEFT writes for the same LoraConfig: key names, shapes, config fields
    made = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=_TARGETS,
                                                         task_type="CAUSAL_LM"))
    made.save_pretrained(tmp_path / "peft")
    mine, peft_own = (load_file(tmp_path / d / "adapter_model.safetensors")
                      for d in ("ours", "peft"))
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in peft_own.items()}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in mine
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"]),
            config["task_type"]) == (4, 8, sorted(_TARGETS), "CAUSAL_LM")


def test_an_adapter_peft_saved_loads_here_with_the_same_outputs(tmp_path):
    peft = pytest.importorskip("peft")
    theirs = peft.get_peft_model(_llama(), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))
    _trained(theirs)
    theirs.save_pretrained(tmp_path)
    ours = lora.load_adapter(_llama(), tmp_path)
    adapted = [n for n, m in ours.named_modules() if isinstance(m, lora.LoRALinear)]
    assert len(adapted) == 2 * 3 and all(ours.get_submodule(n).scale == 2.0 for n in adapted)
    assert lora.trainable_params(ours) == sum(p.numel() for p in theirs.parameters()
                                              if p.requires_grad)
    torch.testing.assert_close(_logits(ours), _logits(theirs), rtol=1e-5, atol=1e-5)
    # and back: what we save again is what PEFT saved
    from safetensors.torch import load_file
    lora.save_adapter(ours, tmp_path / "again")
    first, again = (load_file(p / "adapter_model.safetensors")
                    for p in (tmp_path, tmp_path / "again"))
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


@pytest.mark.parametrize("targets", ["all-linear", r".*\.(q|v)_proj"])
def test_peft_target_modules_all_linear_and_regex_pick_the_same_layers(tmp_path, targets):
    peft = pytest.importorskip("peft")
    theirs = _trained(peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=targets)))
    theirs.save_pretrained(tmp_path)
    ours = lora.load_adapter(_llama(), tmp_path)
    assert sorted(n for n, m in ours.named_modules() if isinstance(m, lora.LoRALinear)) == sorted(
        n.removeprefix("base_model.model.") for n, m in theirs.named_modules()
        if isinstance(m, peft.tuners.lora.LoraLayer))
    assert not isinstance(ours.lm_head, lora.LoRALinear)          # all-linear leaves the head
    torch.testing.assert_close(_logits(ours), _logits(theirs), rtol=1e-5, atol=1e-5)


def test_merge_and_unmerge_give_peft_weights_and_outputs(tmp_path):
    """merge_lora equals PEFT's merge_adapter() bit for bit and its outputs; unmerge_lora
    restores the weights as PEFT's unmerge_adapter() does; unload=True equals
    merge_and_unload(): plain nn.Linear layers."""
    peft = pytest.importorskip("peft")
    ours = _trained(lora.apply_lora(_llama(), 4, _TARGETS, alpha=5))    # s = 1.25: rounds
    lora.save_adapter(ours, tmp_path)
    theirs = peft.PeftModel.from_pretrained(_llama(), tmp_path).eval()
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    adapted = _logits(ours)
    weight = lambda m, n: m.get_submodule(n).weight
    q_ours, q_theirs = "model.layers.1.self_attn.q_proj.base", \
        "base_model.model.model.layers.1.self_attn.q_proj.base_layer"

    assert lora.merge_lora(ours) is ours
    theirs.merge_adapter()
    assert ours.model.layers[1].self_attn.q_proj.merged
    assert torch.equal(weight(ours, q_ours), weight(theirs, q_theirs))
    assert not torch.equal(weight(ours, q_ours), before[q_ours + ".weight"])
    torch.testing.assert_close(_logits(ours), adapted, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(ours), _logits(theirs), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="already merged"):
        lora.merge_lora(ours)

    lora.unmerge_lora(ours)
    theirs.unmerge_adapter()
    assert torch.equal(weight(ours, q_ours), weight(theirs, q_theirs))
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p, before[name], rtol=0, atol=1e-6)
    torch.testing.assert_close(_logits(ours), adapted, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="nothing to unmerge"):
        lora.unmerge_lora(ours)

    plain = lora.merge_lora(ours, unload=True)
    unloaded = theirs.merge_and_unload()
    assert not any(isinstance(m, lora.LoRALinear) for m in plain.modules())
    assert type(plain.model.layers[0].mlp.down_proj) is nn.Linear
    for (n, p), (m, q) in zip(plain.named_parameters(), unloaded.named_parameters()):
        assert n == m and torch.equal(p, q), n
    torch.testing.assert_close(_logits(plain), adapted, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="no LoRA adapter"):
        lora.unmerge_lora(plain)


def test_unload_gives_back_the_base_weights_unmerged():
    base = _llama()
    model = _trained(lora.apply_lora(_llama(), 4, ["q_proj"]))
    lora.merge_lora(model)
    lora.unload_lora(model)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    for (n, p), (m, q) in zip(model.named_parameters(), base.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_merge_unmerge_on_the_course_gpt_and_on_multihead_attention():
    """The same functions on the course GPT (LoRALinear) and on nn.MultiheadAttention
    (LowRankDelta): merged, the function is kept; unmerged, the weights come back."""
    for make in (_gpt, lambda: nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0,
                                                          batch_first=True)):
        model = _trained(lora.apply_lora(make(), rank=2))
        x = (models.make_tokens(2, 8, vocab=31, seed=0)[0] if isinstance(model, models.GPT)
             else torch.randn(2, 5, 16))
        with torch.no_grad():
            adapted = model(x)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        lora.merge_lora(model)
        with torch.no_grad():
            torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)
        lora.unmerge_lora(model)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p, weights[n], rtol=0, atol=1e-6)
        lora.merge_lora(model, unload=True)
        assert not any(isinstance(m, (lora.LoRALinear, lora.LowRankDelta))
                       for m in model.modules())
        with torch.no_grad():
            torch.testing.assert_close(model(x), adapted, rtol=1e-5, atol=1e-5)


def _peft_folder(tmp_path, **config):
    peft = pytest.importorskip("peft")
    theirs = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    theirs.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return tmp_path


@pytest.mark.parametrize("change,match", [
    ({"use_dora": True}, "use_dora = true \\(DoRA"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern = {\"q_proj\": 4} \\(a rank per layer\\)"),
    ({"bias": "all"}, "bias = \"all\""),
    ({"use_rslora": True}, "use_rslora = true"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"init_lora_weights": "pissa"}, "init_lora_weights = \"pissa\""),
    ({"some_new_feature": 3}, "some_new_feature = 3"),
    ({"peft_type": "IA3"}, "only LoRA adapters"),
    ({"r": 0}, "'r' must be a positive whole number, got 0"),
    ({"target_modules": ["nothing_here"]}, "picks no nn.Linear of this model"),
    ({"target_modules": ["q_proj", "v_proj"]}, "no weights for model.layers.0.self_attn.v_proj"),
    ({"r": 3}, "q_proj.lora_A is \\(2, 64\\), this model's layer needs \\(3, 64\\)"),
])
def test_an_adapter_this_cannot_load_is_refused_by_name(tmp_path, change, match):
    folder = _peft_folder(tmp_path, **change)
    model = _llama()
    with pytest.raises(ValueError, match=match):
        lora.load_adapter(model, folder)
    assert not any(isinstance(m, lora.LoRALinear) for m in model.modules())   # untouched


def test_missing_files_and_a_model_that_has_adapters_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no adapter folder"):
        lora.load_adapter(_llama(), tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="adapter_config.json: no such file"):
        lora.load_adapter(_llama(), tmp_path)
    folder = _peft_folder(tmp_path / "a")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors: no such file "
                                                "\\(adapter_model.bin is there: a pickle"):
        lora.load_adapter(_llama(), folder)
    folder = _peft_folder(tmp_path / "b")
    (folder / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="is not a safetensors file"):
        lora.load_adapter(_llama(), folder)
    folder = _peft_folder(tmp_path / "c")
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        lora.load_adapter(lora.apply_lora(_llama(), 2, ["q_proj"]), folder)
    with pytest.raises(ValueError, match="no LoRA adapter to save"):
        lora.save_adapter(_llama(), tmp_path / "d")
    with pytest.raises(ValueError, match="one r and one lora_alpha"):
        lora.save_adapter(lora.apply_lora(lora.apply_lora(_llama(), 2, ["q_proj"]), 4,
                                          ["v_proj"]), tmp_path / "e")
    merged = lora.merge_lora(lora.apply_lora(_llama(), 2, ["q_proj"]))
    with pytest.raises(ValueError, match="unmerge_lora\\(model\\) first"):
        lora.save_adapter(merged, tmp_path / "f")


def test_a_qlora_model_saves_its_adapters_but_is_not_merged_into_nf4(tmp_path):
    from companion.lowbit import apply_qlora
    model = _trained(apply_qlora(_gpt(), 2, ["qkv"], alpha=4))
    with pytest.raises(ValueError, match="cannot merge into an NF4 weight \\(blocks.0.qkv"):
        lora.merge_lora(model)
    lora.save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (2, 4, ["qkv"])
