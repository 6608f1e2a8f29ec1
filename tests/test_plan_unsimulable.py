"""What the fake-tensor simulation cannot run (issue 53, item 5): each model plans, or fails with
one message that names the op, the module and why; never a torch traceback or its logger's lines.

The models of the practitioner's report: one returning a dict, a top-1 MoE routed by `nonzero`,
transformers' Mixtral in fp32 (grouped_mm experts), a ResNet in channels_last, a factory whose
initialisation reads values (`trunc_normal_`, as transformers' ViT). Where the fake step cannot
run, the plan's peaks are the real step measured at small micro-batches and scaled: held against
the real step at the full micro-batch, measured by `track` on a loop of our own."""
import logging
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from companion.memory import track
from companion.plan import fallback
from companion.plan.anymodel import next_token_step, plan_model, simulate_model
from companion.plan.space import Candidate

VOCAB, SEQ = 64, 16


class DictLM(nn.Module):
    """A language model whose forward returns {"logits": ...}."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.seq_len = SEQ
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return {"logits": self.head(h)}


class Top1MoE(nn.Module):
    """Each token to its best expert; each expert's tokens gathered by `nonzero`."""

    def __init__(self, dim: int, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, 4 * dim) for _ in range(experts))

    def forward(self, h):
        flat = h.flatten(0, 1)                                  # (B·T, C)
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            idx = (choice == i).nonzero().squeeze(-1)           # data-dependent length
            out = out.index_add(0, idx, expert(flat[idx]).view(len(idx), 4, -1).sum(1))
        return out.view_as(h)


class MoELM(nn.Module):
    def __init__(self, dim: int = 32, layers: int = 2):
        super().__init__()
        self.seq_len = SEQ
        self.emb = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(Top1MoE(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class Basic(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                    nn.BatchNorm2d(cout)) if stride != 1 or cin != cout
                      else nn.Identity())

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.short(x))


def resnet18(width: int = 8, classes: int = 10) -> nn.Module:
    """ResNet-18 (four stages of two basic blocks) at 1/8 of its width, in channels_last."""
    stages, cin = [], width
    for i, cout in enumerate([width, 2 * width, 4 * width, 8 * width]):
        stages += [Basic(cin, cout, 1 if i == 0 else 2), Basic(cout, cout, 1)]
        cin = cout
    model = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                          nn.ReLU(), nn.Sequential(*stages), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(cin, classes))
    return model.to(memory_format=torch.channels_last)


def image_step(model, batch):
    x = torch.randn(batch, 3, 32, 32).to(memory_format=torch.channels_last)
    return F.cross_entropy(model(x), torch.randint(10, (batch,)))


def mixtral():
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def own_loop_peak(make, step, batch: int) -> int:
    """The real step on a loop of our own: model and AdamW made and stepped once, then one
    forward, backward and step measured by `track` (model and optimizer counted from the start)."""
    torch.manual_seed(1)
    model = make()
    opt = torch.optim.AdamW(model.parameters())
    step(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    with track("cpu", external=(model, opt)) as t:
        step(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return t.peak


def test_the_default_step_reads_logits_from_a_dict_a_model_output_or_a_tuple():
    p = plan_model(DictLM, 4, budget="1 GiB", allow=())
    assert p.model.how == "traced" and not p.model.notes            # simulated, not measured
    assert p.chosen_row.simulated == own_loop_peak(DictLM, next_token_step(SEQ, VOCAB), 4)
    step, x = next_token_step(SEQ, VOCAB), torch.zeros(2, SEQ, VOCAB)
    for out in ({"logits": x}, (x, None), x):
        model = nn.Linear(1, 1)
        model.forward = lambda ids, out=out: out
        assert step(model, 2).numel() == 1
    transformers = pytest.importorskip("transformers")
    model = nn.Linear(1, 1)
    model.forward = lambda ids: transformers.modeling_outputs.CausalLMOutput(logits=x)
    assert step(model, 2).numel() == 1
    for bad, said in (({"hidden": x}, "keys ['hidden']"), (x[0], "shape (16, 64)")):
        model.forward = lambda ids, bad=bad: bad
        with pytest.raises(TypeError, match=r"logits \(batch, seq_len, vocab\).*"
                                            + re.escape(said) + ".*step"):
            step(model, 2)


def test_an_op_with_a_data_dependent_shape_is_named_with_its_module():
    with pytest.raises(RuntimeError) as e:
        plan_model(MoELM, 8, budget="1 GiB", fallback=False)
    said = str(e.value)
    assert said.startswith("aten.nonzero.default in blocks.0 (Top1MoE) cannot run on fake")
    assert "depends on the values of its input" in said and "fallback=True" in said
    assert e.value.__cause__ is None and e.value.__suppress_context__   # no torch traceback


def test_moe_routing_is_measured_for_real_scaled_and_says_so():
    """The real step at micro-batches 2 and 3, extrapolated to 8, against our own loop at 8."""
    p = plan_model(MoELM, 8, budget="1 GiB", allow=())
    assert p.model.how == "measured and scaled"
    notes = " ".join(p.model.notes)
    assert "aten.nonzero.default" in notes and "not the worst case" in notes
    assert "micro-batches 2 and 3" in notes or "micro-batches 3 and 4" in notes
    printed = " ".join(str(p).split())
    assert "Not simulated: aten.nonzero.default" in printed and "not the worst case" in printed
    real = own_loop_peak(MoELM, next_token_step(SEQ, VOCAB), 8)
    assert abs(p.chosen_row.simulated - real) <= 0.10 * real, (p.chosen_row.simulated, real)


def test_the_scaled_step_is_linear_event_by_event_not_phase_by_phase():
    """A phase's peak at small micro-batches can be set by bytes that do not grow (the
    gradients made before the step, in the forward phase): extrapolating each phase's peak from
    2 and 3 falls short; each allocation's live bytes extrapolated do not."""
    step, why = next_token_step(SEQ, VOCAB), fallback.Unsimulable("op", "m", "meta", "e")
    run = lambda c: simulate_model(MoELM, c, step, fake=False)   # noqa: E731
    got, flops, _ = fallback.scaled(run, Candidate(12), 10**4, why)
    real, real_flops, _ = simulate_model(MoELM, Candidate(12), step, fake=False)
    assert abs(got.peak - real.peak) <= 0.05 * real.peak
    assert abs(flops - real_flops) <= 0.05 * real_flops
    assert sum(got.breakdown().values()) == got.peak
    two, three = (fallback._phases(run(Candidate(m))[0].timeline()) for m in (2, 3))
    phase_by_phase = max(two[p][0] + (three[p][0] - two[p][0]) * 10
                         for p in two)                        # the wrong way, for contrast
    assert real.peak - phase_by_phase > 2 * abs(real.peak - got.peak)


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_mixtral_in_fp32_is_measured_for_real_with_no_logger_lines():
    """FakeTensorMode logs a failed meta kernel's traceback ("E1206 ... fake_tensor.py:3090]")
    to its own logger, which does not propagate to pytest's: a handler of our own listens."""
    pytest.importorskip("transformers")
    kept, logger = _Kept(), logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(kept)
    try:
        with pytest.raises(RuntimeError, match=r"aten._grouped_mm.default in model.layers.0.mlp."
                                               r"experts \(MixtralExperts\).*meta kernel.*BF16"):
            plan_model(mixtral, 8, budget="1 GiB", seq_len=SEQ, fallback=False)
        p = plan_model(mixtral, 8, budget="1 GiB", seq_len=SEQ, allow=())
    finally:
        logger.removeHandler(kept)
    assert not kept.records
    assert "aten._grouped_mm.default" in p.model.notes[0]
    assert not any("worst case" in n for n in p.model.notes)        # no routing by values
    real = own_loop_peak(mixtral, next_token_step(SEQ, 256), 8)
    assert abs(p.chosen_row.simulated - real) <= 0.10 * real, (p.chosen_row.simulated, real)


def test_a_channels_last_resnet_is_simulated():
    """Simulated within 16 bytes of our own loop (the planner's step divides the loss by the
    number of micro-batches: one 4-byte tensor more)."""
    p = plan_model(resnet18, 4, budget="1 GiB", step=image_step, allow=())
    assert p.model.how == "traced"
    assert abs(p.chosen_row.simulated - own_loop_peak(resnet18, image_step, 4)) <= 16
    assert p.n_params == sum(q.numel() for q in resnet18().parameters())


def test_transformers_vit_whose_initialisation_reads_values_plans():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_labels=10)

    def vit_step(model, batch):
        logits = model(pixel_values=torch.randn(batch, 3, 32, 32)).logits
        return F.cross_entropy(logits, torch.randint(10, (batch,)))

    make = lambda: transformers.ViTForImageClassification(config)   # noqa: E731
    p = plan_model(make, 4, budget="1 GiB", step=vit_step, allow=())
    assert p.model.how == "traced"
    assert abs(p.chosen_row.simulated - own_loop_peak(make, vit_step, 4)) <= 16


def test_a_factory_that_converts_or_reads_values_builds_on_fake_tensors():
    """Built on the meta device, then made fake: strides kept, shared weights still shared."""
    from torch._subclasses import FakeTensorMode
    from companion.plan.anysim import build_model

    def tied():
        model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB, bias=False))
        model[1].weight = model[0].weight
        nn.init.trunc_normal_(model[0].weight)               # calls .item()
        return model.float()                                 # swaps each parameter

    with FakeTensorMode():
        model = build_model(tied)
        conv = build_model(resnet18)[0].weight
    assert model[1].weight is model[0].weight
    assert sum(q.numel() for q in model.parameters()) == VOCAB * 32
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert plan_model(tied, 4, budget="1 GiB", seq_len=SEQ, allow=()).model.how == "traced"


def test_an_error_of_the_step_itself_is_not_blamed_on_fake_tensors():
    class Wrong(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(VOCAB, 32), nn.Linear(16, VOCAB)

        def forward(self, x):
            return self.head(self.emb(x))                    # 32 features into 16

    with pytest.raises(RuntimeError, match="The real step fails too.*step itself is wrong"):
        plan_model(Wrong, 4, budget="1 GiB", seq_len=SEQ, allow=())


def test_a_model_too_large_for_this_machine_is_not_run_for_real(monkeypatch):
    monkeypatch.setattr(fallback, "available_bytes", lambda: 2**20)
    with pytest.raises(RuntimeError, match=r"aten.nonzero.default.*parameters x 16 B"):
        plan_model(MoELM, 8, budget="1 GiB")


def test_the_command_line_reports_the_op_in_one_line(tmp_path):
    (tmp_path / "moe.py").write_text(textwrap.dedent("""
        import sys
        sys.path.insert(0, %r)
        from test_plan_unsimulable import MoELM
        def build():
            return MoELM()
    """ % str(__import__("pathlib").Path(__file__).parent)))
    args = [sys.executable, "-m", "companion", "plan", "--model", str(tmp_path / "moe.py:build"),
            "--batch", "8", "--budget", "1GiB", "--device", "cpu", "--allow", "accumulation"]
    bad = subprocess.run(args + ["--no-fallback"], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and "aten.nonzero.default" in bad.stderr
    good = subprocess.run(args, capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "Not simulated: aten.nonzero.default" in good.stdout


@pytest.mark.parametrize("batch", [8, 32])
def test_on_one_device_the_worst_routing_needs_the_bytes_random_routing_does(batch):
    """What the fallback's note says of routing: experts that take their tokens by index see each
    token once (top-1) whatever the router decides, so every token sent to one expert peaks at
    the same byte as random routing. A step that split experts over devices would differ."""
    import hf_zoo                                      # tests/ is on sys.path

    def peak(skewed: bool) -> tuple[int, list[int]]:
        torch.manual_seed(0)
        model = hf_zoo.Top1MoE()
        if skewed:
            with torch.no_grad():
                model.router.weight.zero_()
                model.router.bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
        routed = []
        model.router.register_forward_hook(
            lambda m, a, out: routed.append(torch.bincount(out.argmax(-1), minlength=4).tolist()))
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(2):                                 # the second step, state made
            with track("cpu", external=(model, opt), modules=model) as t:
                hf_zoo.token_step(model, batch).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        return t.peak, routed[-1]

    (random_peak, random_counts), (skewed_peak, skewed_counts) = peak(False), peak(True)
    assert skewed_counts == [batch * hf_zoo.T, 0, 0, 0] and max(random_counts) < batch * hf_zoo.T
    assert skewed_peak == random_peak
