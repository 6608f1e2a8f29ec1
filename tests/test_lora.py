"""LoRA: the adapter computes W + s·B·A, its gradients are the hand-derived ones, the base stays
frozen, and gradients and optimizer state exist only for the adapters (measured)."""
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
