"""Issue 53's bar: every model of the practitioner's trial (tests/hf_zoo.py) plans without a
traceback, its chosen plan's simulated peak is the real step's (run by `Plan.check()`, which runs
no FLOP counter), and LoRA merges and unmerges on each model with linear layers, output for
output."""
import pytest
import torch

pytest.importorskip("transformers")

import hf_zoo                                             # noqa: E402  (tests/ is on sys.path)
from companion import lora                                # noqa: E402
from companion.plan import plan_model                     # noqa: E402


@pytest.mark.parametrize("name", sorted(hf_zoo.ALL))
def test_each_model_of_the_trial_plans_and_its_plan_runs(name):
    make, step = hf_zoo.ALL[name]
    plan = plan_model(make, 4, budget="4 GiB", step=step, device="cpu")
    assert "Traceback" not in str(plan)
    assert plan.n_params == sum(p.numel() for p in set(make().parameters()))
    real, simulated = plan.check().peak, plan.chosen_row.peak
    assert abs(simulated / real - 1) <= 0.10, (name, simulated, real)


TIED = {"hf_qwen2_tied": "lm_head.*embed_tokens", "hf_t5": "lm_head.*shared"}


@pytest.mark.parametrize("name", sorted(set(hf_zoo.ALL) - set(TIED)))   # tied: the next test
def test_lora_merges_and_unmerges_on_each_model(name):
    make, step = hf_zoo.ALL[name]
    torch.manual_seed(0)
    model = make().eval()
    try:
        lora.apply_lora(model, 2)         # the classifiers' heads have 3 and 10 outputs
    except ValueError as e:                               # no linear layer to adapt
        assert "linear" in str(e).lower() or "nn.Linear" in str(e)
        pytest.skip(f"{name}: {e}")
    for name_, p in model.named_parameters():             # a trained adapter: B away from zero
        if name_.endswith(".B"):
            torch.nn.init.normal_(p, std=0.02)
    torch.manual_seed(1)
    with torch.no_grad():
        before = step(model, 2)
        torch.manual_seed(1)
        lora.merge_lora(model)
        merged = step(model, 2)
        lora.unmerge_lora(model)
        torch.manual_seed(1)
        back = step(model, 2)
    torch.testing.assert_close(merged, before, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(back, before, rtol=1e-4, atol=1e-5)
    lora.merge_lora(model, unload=True)
    torch.manual_seed(1)
    with torch.no_grad():
        torch.testing.assert_close(step(model, 2), before, rtol=1e-4, atol=1e-5)
    assert not any(isinstance(m, lora.LoRALinear) for m in model.modules())


@pytest.mark.parametrize("name", sorted(TIED))
def test_a_head_tied_to_the_embedding_is_merged_into_a_weight_of_its_own(name):
    make, step = hf_zoo.ALL[name]
    model = make().eval()
    lora.apply_lora(model, 2)
    torch.nn.init.normal_(model.lm_head.B, std=0.02)
    embedding = model.get_input_embeddings().weight.detach().clone()
    torch.manual_seed(1)
    with torch.no_grad():
        before = step(model, 2)
    with pytest.raises(ValueError, match=TIED[name]):
        lora.merge_lora(model)                # in place would change the embedding too
    assert not model.lm_head.merged       # refused before anything was merged
    lora.merge_lora(model, unload=True)
    torch.testing.assert_close(model.get_input_embeddings().weight, embedding, rtol=0, atol=0)
    torch.manual_seed(1)
    with torch.no_grad():
        torch.testing.assert_close(step(model, 2), before, rtol=1e-4, atol=1e-5)


def test_why_oom_for_a_model_of_ones_own_compares_fixes_with_a_bf16_step(tmp_path):
    """`--why-oom` was read only for a published model; for a factory it printed the plan."""
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-m", "companion", "plan", "--model", "tests/hf_zoo.py:hf_llama",
         "--step", "tests/hf_zoo.py:padded_lm_step", "--batch", "8", "--budget", "531MiB",
         "--device", "cuda", "--gpu", "RTX 4090", "--why-oom", "--allow", "accumulation",
         "autocast"], capture_output=True, text=True, timeout=600,
        cwd=__import__("pathlib").Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    assert "the plain step needs" in out.stdout and " over, at the " in out.stdout
    fixes = [line for line in out.stdout.splitlines() if line.startswith("  fix: ")]
    assert fixes and all("x a bf16 step of the whole batch" in f for f in fixes), out.stdout
    assert "micro-batches" in fixes[0]
