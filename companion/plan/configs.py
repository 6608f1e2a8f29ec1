"""Read a Hugging Face `config.json` without `transformers`: the sizes the planner needs.

GPT-2 (`n_embd`, `n_layer`, `n_head`, `n_positions`, `vocab_size`, `n_inner`; head tied to the
embedding) and the Llama family (Llama, Mistral, Qwen2: `hidden_size`, `num_hidden_layers`,
`num_attention_heads`, `num_key_value_heads`, `intermediate_size`, `vocab_size`,
`max_position_embeddings`, `tie_word_embeddings`, `rope_theta` (or transformers 5's
`rope_parameters`), `rms_norm_eps`, `head_dim`; Qwen2's q, k and v projections carry biases, a
Llama's q, k, v and o with `attention_bias` and its gate, up and down with `mlp_bias`, as
transformers builds them). Every key read is checked: a wrong type or a value that is not
positive is an error naming the key. A `model_type` outside these is refused with a two-line
factory that builds it with transformers, for `--model factory.py:build`. A few published
configurations ship as JSON files in the folder `configs/` beside this module, written from the
models' config.json files on the Hugging Face Hub (which the test machines cannot reach; each file's
"_source" says where its values were read); `n_params` equals each model card's count
(tests/test_plan_configs.py).

`model_fn` builds the model the config describes: a GPT-2 shape as the course's
`companion.models.GPT` with `tie_head` (GPT-2's head is the token embedding, no bias:
`tie_word_embeddings`, true unless the config says otherwise), whose learned positions are seq_len
long (GPT-2 XL at 1,024 tokens: 1,557,611,200 parameters, the published count); a Llama shape as
`companion.models.Llama`, tied where `tie_word_embeddings` says so (Llama 3.2 1B, Qwen2.5 0.5B),
with the published count exactly. Tied, the head is one tensor with the embedding: its weights,
gradients and AdamW states are counted once.

Example:
    >>> load_config("llama-3-8b").n_params()
    8030261248
    >>> model_fn = load_config("mistral-7b").model_fn(4096)   # model_fn(dtype=, device=)

Simplified vs `transformers.AutoConfig`: two families; no rope scaling (Llama 3.1), no sliding
window (Mistral's is read and ignored: every earlier token is attended to), no head_dim other
than hidden_size / heads.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from typing import Callable

from companion.estimate_llama import llama_params

__all__ = ["ModelConfig", "load_config", "from_dict", "shipped"]

_FOLDER = pathlib.Path(__file__).with_name("configs")
_LLAMA_TYPES = ("llama", "mistral", "qwen2")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder's sizes, as a config.json gives them."""

    name: str
    family: str               # "gpt2" or "llama"
    vocab: int
    width: int
    depth: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    qkv_bias: bool = False    # q, k and v (Qwen2; Llama's attention_bias)
    o_bias: bool = False      # o (Llama's attention_bias)
    mlp_bias: bool = False    # gate, up and down (Llama's mlp_bias)

    def n_params(self) -> int:
        """The published model's parameters, by formula.
        GPT-2: (V + T)·C + L·(4·C² + 2·C·I + 9·C + I) + 2·C, head tied (T: n_positions; with
        I = 4C a layer is 12·C² + 13·C); untied (`tie_word_embeddings` false) V·C more.
        Llama: `companion.estimate.llama_params` (V·C + L·(2·C + 2·C·(h·d) + 2·C·(kv·d) +
        3·C·I) + C + V·C untied, d = C / h; per layer q, k, v biases h·d + 2·kv·d, o's C and
        the MLP's 2·I + C); equal to transformers' count of the same config
        (tests/test_plan_configs.py)."""
        V, C, L, I = self.vocab, self.width, self.depth, self.intermediate
        if self.family == "gpt2":
            return ((V + self.max_seq_len) * C + L * (4 * C * C + 2 * C * I + 9 * C + I) + 2 * C
                    + (0 if self.tied else V * C))
        return llama_params(V, C, L, self.heads, kv_heads=self.kv_heads, intermediate=I,
                            tied=self.tied, qkv_bias=self.qkv_bias, o_bias=self.o_bias,
                            mlp_bias=self.mlp_bias)

    def built_params(self, seq_len: int | None = None) -> int:
        """Parameters of the model `model_fn(seq_len)` builds, which the planner simulates.
        Llama shapes: `n_params()`. GPT-2: the course GPT learns seq_len positions, not
        n_positions (fewer below the config's longest); an untied head has a bias (V more)."""
        if self.family != "gpt2":
            return self.n_params()
        T = self._seq_len(seq_len)
        V, C = self.vocab, self.width
        return self.n_params() + (0 if self.tied else V) + (T - self.max_seq_len) * C

    def model_fn(self, seq_len: int | None = None) -> Callable:
        """A function of dtype= and device= (and fused_attention=, always True) that builds
        the model for sequences of `seq_len` tokens (default: the config's longest)."""
        from companion.models import GPT, Llama
        T = self._seq_len(seq_len)
        if self.family == "llama":
            return functools.partial(Llama, self.vocab, T, self.width, self.depth, self.heads,
                                     kv_heads=self.kv_heads, intermediate=self.intermediate,
                                     tied=self.tied, qkv_bias=self.qkv_bias,
                                     o_bias=self.o_bias, mlp_bias=self.mlp_bias,
                                     rope_theta=self.rope_theta, norm_eps=self.norm_eps)
        if self.intermediate != 4 * self.width:
            raise ValueError(f"{self.name}: the course GPT's MLP is 4 x n_embd = "
                             f"{4 * self.width} wide, this config's n_inner is "
                             f"{self.intermediate}; it can be counted but not built")
        return functools.partial(GPT, self.vocab, T, self.width, self.depth, self.heads,
                                 fused_attention=True, tie_head=self.tied)

    def _seq_len(self, seq_len: int | None) -> int:
        if seq_len is None:
            return self.max_seq_len
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive whole number, got {seq_len!r}")
        if seq_len > self.max_seq_len:
            raise ValueError(f"{self.name} takes at most {self.max_seq_len} tokens, got "
                             f"seq_len={seq_len}")
        return seq_len


_REQUIRED = object()
_KINDS = {int: "a positive whole number", float: "a positive finite number",
          bool: "true or false", str: "a string"}


def _get(config: dict, key: str, where: str, kind: type = int, default=_REQUIRED):
    """config[key], checked: an int a positive whole number (not a bool, not 256.0 or "256"), a
    float a positive finite number (an int is taken), a bool true or false; a missing or null
    key is `default`, or an error naming the key when there is none."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{where}: the config has no {key!r}; add it (see the model's "
                             "config.json on the Hugging Face Hub)")
        return default
    if kind is int:
        good = isinstance(value, int) and not isinstance(value, bool) and value > 0
    elif kind is float:
        good = (isinstance(value, (int, float)) and not isinstance(value, bool)
                and 0 < value < math.inf)
        value = float(value) if good else value
    else:
        good = isinstance(value, kind)
    if not good:
        raise ValueError(f"{where}: {key!r} must be {_KINDS[kind]}, got {json.dumps(value)} "
                         f"({_JSON_TYPES.get(type(value), type(value).__name__)})")
    return value


_JSON_TYPES = {str: "a string", int: "a whole number", float: "a number", bool: "a boolean",
               list: "a list", dict: "an object"}


def _gpt2(config: dict, name: str) -> ModelConfig:
    C, heads = _get(config, "n_embd", name), _get(config, "n_head", name)
    if C % heads:
        raise ValueError(f"{name}: n_embd {C} is not a multiple of n_head {heads}")
    return ModelConfig(name, "gpt2", _get(config, "vocab_size", name), C,
                       _get(config, "n_layer", name), heads, heads,
                       _get(config, "n_inner", name, default=4 * C),
                       _get(config, "tie_word_embeddings", name, bool, True),  # GPT-2's default
                       _get(config, "n_positions", name),
                       norm_eps=_get(config, "layer_norm_epsilon", name, float, 1e-5))


def _rope_theta(config: dict, name: str) -> float:
    """rope_theta: a key of its own (transformers 4), or inside rope_parameters (transformers 5
    writes {"rope_type": ..., "rope_theta": ...}; `LlamaConfig.to_json_string()`)."""
    rope = config.get("rope_parameters")
    if rope is not None and not isinstance(rope, dict):
        raise ValueError(f"{name}: 'rope_parameters' must be an object, got {json.dumps(rope)}")
    if rope and rope.get("rope_theta") is not None:
        return _get(rope, "rope_theta", f"{name}: rope_parameters", float)
    return _get(config, "rope_theta", name, float, 10000.0)


def _llama(config: dict, name: str) -> ModelConfig:
    heads, C = _get(config, "num_attention_heads", name), _get(config, "hidden_size", name)
    kv_heads = _get(config, "num_key_value_heads", name, default=heads)
    if C % heads:
        raise ValueError(f"{name}: hidden_size {C} is not a multiple of num_attention_heads "
                         f"{heads}")
    if heads % kv_heads:
        raise ValueError(f"{name}: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv_heads}")
    head_dim = _get(config, "head_dim", name, default=C // heads)
    if head_dim != C // heads:
        raise ValueError(f"{name}: head_dim {head_dim} differs from hidden_size / "
                         f"num_attention_heads = {C // heads}; companion.models.Llama supports "
                         "only head_dim = hidden_size / heads")
    # Biases as transformers 5.25 builds each family (models/*/modeling_*.py): Llama's
    # attention_bias puts them on q, k, v and o, its mlp_bias on gate, up and down; Qwen2 has
    # them on q, k and v always, Mistral nowhere (both ignore the two keys).
    kind = config["model_type"]
    attention = kind == "llama" and _get(config, "attention_bias", name, bool, False)
    mlp = kind == "llama" and _get(config, "mlp_bias", name, bool, False)
    return ModelConfig(name, "llama", _get(config, "vocab_size", name), C,
                       _get(config, "num_hidden_layers", name), heads, kv_heads,
                       _get(config, "intermediate_size", name),
                       _get(config, "tie_word_embeddings", name, bool, False),
                       _get(config, "max_position_embeddings", name),
                       rope_theta=_rope_theta(config, name),
                       norm_eps=_get(config, "rms_norm_eps", name, float, 1e-6),
                       qkv_bias=kind == "qwen2" or attention, o_bias=attention, mlp_bias=mlp)


def _unsupported(kind, name: str) -> str:
    source = (f'"{name}"' if name.endswith(".json") else '"PATH/config.json"')
    return (f"{name}: model_type {kind!r} is not supported; supported: gpt2, "
            + ", ".join(_LLAMA_TYPES) + ". Plan it as your own model, built by transformers "
            "(pip install transformers), with --model factory.py:build, factory.py being:\n"
            "    from transformers import AutoConfig, AutoModelForCausalLM\n"
            f"    def build(): return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("
            f"{source}))\n"
            "and --batch, --seq-len and --gpu (or --budget) as for any model of yours")


def from_dict(config: dict, *, name: str = "config") -> ModelConfig:
    """A ModelConfig from a parsed config.json; `name` says where it came from in errors.
    Every key read is checked (a string "256" for hidden_size is an error naming the key)."""
    if not isinstance(config, dict):
        raise ValueError(f"{name}: a config.json holds one JSON object ({{\"model_type\": ...}}), "
                         f"this one {_JSON_TYPES.get(type(config), type(config).__name__)}")
    kind = config.get("model_type")
    if kind is None:
        raise ValueError(f"{name}: the config has no 'model_type' (a Hugging Face config.json "
                         "says which model it describes, e.g. \"llama\")")
    if not isinstance(kind, str):
        raise ValueError(f"{name}: 'model_type' must be a string, got {json.dumps(kind)}")
    if kind == "gpt2":
        return _gpt2(config, name)
    if kind in _LLAMA_TYPES:
        return _llama(config, name)
    raise ValueError(_unsupported(kind, name))


def shipped() -> list[str]:
    """The names `load_config` knows without a file: the JSON files in `configs/`."""
    return sorted(path.stem for path in _FOLDER.glob("*.json"))


def load_config(name_or_path: str | pathlib.Path) -> ModelConfig:
    """A shipped model by name (case-insensitive: `shipped()`), or a config.json by path (a
    folder holding one, such as a downloaded Hub snapshot, works too)."""
    key = str(name_or_path).lower()
    if key in shipped():
        return from_dict(_read(_FOLDER / f"{key}.json"), name=key)
    path = pathlib.Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"no file {path}")
        return from_dict(_read(path), name=str(path))
    raise ValueError(f"unknown model {name_or_path!r}: give a config.json path or one of "
                     + ", ".join(shipped()))


def _read(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
