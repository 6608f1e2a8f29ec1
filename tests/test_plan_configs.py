"""companion.plan.configs and `python -m companion plan --model NAME|config.json`."""
import json
import subprocess
import sys

import pytest
import torch
from torch._subclasses import FakeTensorMode

from companion.estimate import gpt_params
from companion.models import GPT, Llama
from companion.plan.configs import _FOLDER, from_dict, load_config, shipped
from companion.plan.named import parse_batch, plan_dict, plan_named
from companion.plan.parts import state_bytes
from companion.plan.space import Candidate, GPTShape

# Each model card's parameter count (Hugging Face Hub, safetensors metadata / model cards); Llama
# 3 70B's and 3.1 405B's cards print 70.6B and 405.9B, which these counts round to.
PUBLISHED = {"gpt2-xl": 1_557_611_200, "llama-3-8b": 8_030_261_248,
             "mistral-7b": 7_241_732_096, "qwen2.5-7b": 7_615_616_512,
             "llama-3.1-8b": 8_030_261_248, "llama-2-7b": 6_738_415_616,
             "llama-2-13b": 13_015_864_320, "llama-2-70b": 68_976_648_192,
             "llama-3-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800}


def _built(model_fn) -> tuple[torch.nn.Module, int]:
    with FakeTensorMode():                                  # no memory: shapes only
        model = model_fn(dtype=torch.bfloat16, device="cpu", fused_attention=True)
    return model, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shipped_configs_count_the_published_parameters(name):
    config = load_config(name)
    assert config.n_params() == PUBLISHED[name]
    assert load_config(name.upper()).name == name
    source = json.loads((_FOLDER / f"{name}.json").read_text())["_source"]
    assert "huggingface.co" in source and f"{PUBLISHED[name]:,}" in source


@pytest.mark.parametrize("name", ["llama-3-8b", "mistral-7b", "qwen2.5-7b", "llama-3.1-8b",
                                  "llama-2-7b"])
def test_llama_shapes_build_with_the_published_count(name):
    config = load_config(name)
    model, n = _built(config.model_fn(512))
    assert isinstance(model, Llama) and n == PUBLISHED[name] == config.built_params(512)
    block = model.blocks[0]
    assert (block.heads, block.kv_heads, block.fused_attention) == (
        config.heads, config.kv_heads, True)
    assert (block.q_proj.bias is not None) == (name == "qwen2.5-7b")
    assert model.seq_len == 512 and model.rotary.cos.shape == (512, config.width // config.heads)


def test_gpt2_xl_is_built_with_its_head_tied_to_the_embedding():
    """GPT-2 ties its head to the token embedding (no bias): the built model holds the published
    1,557,611,200 parameters at 1,024 tokens (the course GPT learns seq_len positions, so fewer
    at 256), and the plan's states count the head once (an untied head: 1,638,072,657)."""
    config = load_config("gpt2-xl")
    V, C = config.vocab, config.width
    for T in (1024, 256):
        model, n = _built(config.model_fn(T))
        assert isinstance(model, GPT) and model.head.weight is model.tok.weight
        assert model.head.bias is None
        assert n == config.built_params(T) == gpt_params(V, T, C, 48, tied=True)
        assert n - config.n_params() == (T - 1024) * C
    assert config.built_params(1024) == PUBLISHED["gpt2-xl"] == 1_557_611_200
    assert gpt_params(V, 1024, C, 48) == 1_638_072_657              # the untied course GPT
    shape = GPTShape.of(config.model_fn(1024))
    assert shape.tied and shape.n_params == 1_557_611_200
    weights, grads, optimizer, _, _ = state_bytes(shape, Candidate(1), 1)
    assert (weights, grads, optimizer) == (4 * 1_557_611_200, 4 * 1_557_611_200,
                                           8 * 1_557_611_200)
    with pytest.raises(ValueError, match="at most 1024"):
        config.model_fn(2048)


def test_tie_word_embeddings_is_read_for_each_family(tmp_path):
    """A GPT-2 config that unties its head, and a small Llama that ties it (Llama 3.2 1B, Qwen2.5
    0.5B do): each built as described, each counted as built."""
    path = tmp_path / "config.json"
    gpt2 = {"model_type": "gpt2", "vocab_size": 100, "n_positions": 32, "n_embd": 64,
            "n_layer": 2, "n_head": 4}
    for tie in (True, False):
        path.write_text(json.dumps({**gpt2, "tie_word_embeddings": tie}))
        config = load_config(path)
        model, n = _built(config.model_fn())
        assert (model.head.weight is model.tok.weight) == tie == GPTShape.of(config.model_fn()).tied
        assert n == config.built_params() == gpt_params(100, 32, 64, 2, tied=tie)
        assert n - config.n_params() == (0 if tie else 100)        # the course head's bias
    llama = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 96,
             "vocab_size": 100, "max_position_embeddings": 32, "tie_word_embeddings": True}
    path.write_text(json.dumps(llama))
    config = load_config(path)
    model, n = _built(config.model_fn())
    assert model.head.weight is model.tok.weight and n == config.n_params()
    assert GPTShape.of(config.model_fn()).n_params == n


def test_a_config_json_on_disk_and_its_errors(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
                                "n_embd": 768, "n_layer": 12, "n_head": 12}))
    assert load_config(path).n_params() == 124_439_808            # GPT-2 small
    assert load_config(tmp_path).n_params() == 124_439_808        # the folder holding it
    path.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="'bert' is not supported; supported: gpt2, llama"):
        load_config(path)
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match=f"{path}: the config has no 'num_attention_heads'"):
        load_config(path)
    llama = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
             "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100,
             "max_position_embeddings": 32}
    path.write_text(json.dumps({**llama, "head_dim": 32}))
    with pytest.raises(ValueError, match="head_dim 32 differs"):
        load_config(path)
    path.write_text(json.dumps({**llama, "head_dim": 16, "attention_bias": True}))
    config = load_config(path)
    assert (config.kv_heads, config.tied, config.qkv_bias, config.rope_theta) == (
        4, False, True, 10000.0)
    assert _built(config.model_fn())[1] == config.n_params()
    path.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_config(path)
    with pytest.raises(ValueError, match="no file"):
        load_config(tmp_path / "missing.json")
    with pytest.raises(ValueError, match=", ".join(sorted(PUBLISHED))):
        load_config("gpt-5")
    assert shipped() == sorted(PUBLISHED)


def test_batch_in_tokens_or_sequences():
    assert parse_batch("1M-tokens", 4096, 8) == 256
    assert parse_batch("512K-tokens", 1024) == 512
    assert parse_batch("100", 1024, 8) == 96
    with pytest.raises(ValueError, match="tokens"):
        parse_batch("lots", 1024)


def test_plan_named_fits_each_plan_and_says_why():
    result = plan_named("gpt2-xl", gpu="A100 80GB", seq_len=1024, batch=32, verify=0)
    data = plan_dict(result, top=3)
    assert data["gpu"] == "A100 80GB" and data["n_params"] == 1_557_611_200
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


# ------------------------------------------- every field read, counted as transformers counts it

def _transformers_count(config) -> int:
    """transformers' own count of a config: its model built on the meta device (no memory)."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("attention_bias", [False, True])
@pytest.mark.parametrize("mlp_bias", [False, True])
@pytest.mark.parametrize("tied,kv_heads", [(False, 4), (True, 2)])
def test_llama_biases_count_as_transformers_builds_them(attention_bias, mlp_bias, tied, kv_heads):
    """attention_bias gives q, k, v AND o biases, mlp_bias gate, up and down's (transformers 5.25,
    models/llama/modeling_llama.py): the count, the model built and the planner's shape equal
    transformers' count of the same config, and the planner's states hold every bias."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172,
                                  num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                                  attention_bias=attention_bias, mlp_bias=mlp_bias)
    expected = _transformers_count(hf)
    config = from_dict(json.loads(hf.to_json_string()))
    assert config.n_params() == expected
    model, n = _built(config.model_fn(64))
    block = model.blocks[0]
    assert n == expected and (block.o_proj.bias is not None) == attention_bias
    assert (block.down_proj.bias is not None) == mlp_bias
    shape = GPTShape.of(config.model_fn(64))
    assert shape.n_params == expected
    head = 0 if tied else 256 * 64
    assert 256 * 64 + head + 64 + 3 * shape.block_params() == expected
    weights, grads, optimizer, _, _ = state_bytes(shape, Candidate(1), 1)
    assert (weights, grads, optimizer) == (4 * expected, 4 * expected, 8 * expected)


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_qwen2_and_mistral_ignore_the_llama_bias_keys_as_transformers_does(kind):
    transformers = pytest.importorskip("transformers")
    cls = {"qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig}[kind]
    hf = cls(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
    data = {**json.loads(hf.to_json_string()), "attention_bias": True, "mlp_bias": True}
    config = from_dict(data)
    assert config.n_params() == _transformers_count(hf) == _built(config.model_fn(32))[1]
    assert (config.qkv_bias, config.o_bias, config.mlp_bias) == (kind == "qwen2", False, False)


def test_rope_theta_is_read_where_transformers_5_writes_it():
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    data = json.loads(hf.to_json_string())
    assert "rope_theta" not in data                     # inside rope_parameters
    assert from_dict(data).rope_theta == 5e5
    assert from_dict({**data, "rope_parameters": None, "rope_theta": 1e6}).rope_theta == 1e6


_SMALL = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100,
          "max_position_embeddings": 32}


@pytest.mark.parametrize("key,value,match", [
    ("hidden_size", "256",
     "'hidden_size' must be a positive whole number, got \"256\" \\(a string"),
    ("hidden_size", 64.0, "'hidden_size' must be a positive whole number, got 64.0"),
    ("num_hidden_layers", 0, "'num_hidden_layers' must be a positive whole number, got 0"),
    ("vocab_size", -100, "'vocab_size' must be a positive whole number, got -100"),
    ("num_attention_heads", True,
     "'num_attention_heads' must be a positive whole number, got true"),
    ("num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("num_attention_heads", 5, "hidden_size 64 is not a multiple of num_attention_heads 5"),
    ("rms_norm_eps", float("nan"), "'rms_norm_eps' must be a positive finite number, got NaN"),
    ("rope_theta", "1e4", "'rope_theta' must be a positive finite number"),
    ("tie_word_embeddings", 1, "'tie_word_embeddings' must be true or false, got 1"),
    ("attention_bias", "yes", "'attention_bias' must be true or false"),
    ("mlp_bias", 0, "'mlp_bias' must be true or false, got 0"),
    ("model_type", 7, "'model_type' must be a string"),
])
def test_every_field_read_is_checked_and_named(key, value, match):
    with pytest.raises(ValueError, match=match):
        from_dict({**_SMALL, key: value})


def test_a_config_that_is_not_an_object_or_has_no_model_type_is_refused(tmp_path):
    path = tmp_path / "config.json"
    for data, match in ([[1, 2], "one JSON object .* this one a list"],
                        ["llama", "this one a string"], [{}, "has no 'model_type'"]):
        path.write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match):
            load_config(path)
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="is not JSON"):
        load_config(path)


def test_a_refused_model_type_says_how_to_plan_it_with_transformers(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_SMALL, "model_type": "phi3"}))
    with pytest.raises(ValueError) as e:
        load_config(path)
    text = str(e.value)
    assert "model_type 'phi3' is not supported; supported: gpt2, llama, mistral, qwen2" in text
    assert "--model factory.py:build" in text
    assert f'AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("{path}"))' in text


def test_seq_len_zero_is_an_error_not_the_longest():
    config = load_config("llama-3-8b")
    for bad in (0, -1, True, 8.5):
        with pytest.raises(ValueError, match="seq_len must be a positive whole number"):
            config.model_fn(bad)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="seq_len must be a whole number of at least 1"):
            plan_named("llama-3-8b", seq_len=bad, verify=0)
    with pytest.raises(ValueError, match="gpus must be a whole number of at least 1, got 0"):
        plan_named("llama-3-8b", gpus=0, verify=0)
    with pytest.raises(ValueError, match="gpus must be a whole number of at least 1, got 0"):
        parse_batch("1M-tokens", 4096, 0)
    for bad in ("0", 0, "1..2M-tokens", True):
        with pytest.raises(ValueError, match="--batch"):
            parse_batch(bad, 4096)
