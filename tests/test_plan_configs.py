"""companion.plan.configs and `python -m companion plan --model NAME|config.json`."""
import json
import subprocess
import sys

import pytest

from companion.plan.configs import load_config, shipped
from companion.plan.named import parse_batch, plan_dict, plan_named

# Each model card's parameter count (Hugging Face Hub, safetensors metadata / model cards).
PUBLISHED = {"gpt2-xl": 1_557_611_200, "llama-3-8b": 8_030_261_248,
             "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_count_the_published_parameters(name):
    assert load_config(name).n_params() == PUBLISHED[name]
    assert load_config(name.upper()).name == name


def test_a_config_json_on_disk_and_its_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
                                "n_embd": 768, "n_layer": 12, "n_head": 12}))
    assert load_config(path).n_params() == 124_439_808            # GPT-2 small
    path.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="not supported"):
        load_config(path)
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_config(path)
    with pytest.raises(ValueError, match="gpt2-xl"):
        load_config("gpt-5")
    assert shipped() == sorted(PUBLISHED)


def test_the_course_gpt_built_for_gpt2_xl_has_an_untied_head():
    from companion.plan import GPTShape
    config = load_config("gpt2-xl")
    built = GPTShape.of(config.model_fn(1024)).n_params
    assert built - config.n_params() == 50257 * 1600 + 50257          # head weight and bias
    with pytest.raises(ValueError, match="Llama-shaped"):
        load_config("llama-3-8b").model_fn(4096)


def test_batch_in_tokens_or_sequences():
    assert parse_batch("1M-tokens", 4096, 8) == 256
    assert parse_batch("512K-tokens", 1024) == 512
    assert parse_batch("100", 1024, 8) == 96
    with pytest.raises(ValueError, match="tokens"):
        parse_batch("lots", 1024)


def test_plan_named_fits_each_plan_and_says_why():
    result = plan_named("gpt2-xl", gpu="A100 80GB", seq_len=1024, batch=32, verify=0)
    data = plan_dict(result, top=3)
    assert data["gpu"] == "A100 80GB" and data["n_params"] == 1_638_072_657
    for row in data["plans"]:
        assert row["gpu_bytes"] <= data["budget"]
        names = [line["name"] for line in row["memory_lines"]]
        assert names[0] == "tensors at the peak" and "CUDA context" in names
        assert row["seconds"]["total"] > 0
    json.dumps(data)


def test_the_command_line_prints_plans_why_oom_and_json():
    run = [sys.executable, "-m", "companion", "plan", "--model", "gpt2-xl", "--gpu", "RTX 4090",
           "--seq-len", "1024", "--batch", "16", "--simulate", "0"]
    text = subprocess.run(run, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    assert "CUDA context" in text.stdout and "Not searched: tensor and pipeline" in text.stdout
    why = subprocess.run(run + ["--why-oom"], capture_output=True, text=True, timeout=300)
    assert "over, at the" in why.stdout and "fix:" in why.stdout
    out = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=300)
    assert json.loads(out.stdout)["plans"]
    bad = subprocess.run([sys.executable, "-m", "companion", "plan", "--model", "llama-3-8b"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Llama-shaped" in bad.stderr
