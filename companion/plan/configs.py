"""Read a Hugging Face `config.json` without `transformers`: the sizes the planner needs.

GPT-2 (`n_embd`, `n_layer`, `n_head`, `n_positions`, `vocab_size`, `n_inner`; head tied to the
embedding) and the Llama family (Llama, Mistral, Qwen2: `hidden_size`, `num_hidden_layers`,
`num_attention_heads`, `num_key_value_heads`, `intermediate_size`, `vocab_size`,
`max_position_embeddings`, `tie_word_embeddings`, `rope_theta`, `rms_norm_eps`; Qwen2's q, k and
v projections carry biases, as do Llama's with `attention_bias`). A few published configurations
ship as JSON files in the folder `configs/` beside this module, written from the models'
config.json files on the Hugging Face Hub (which the test machines cannot reach; each file's
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
    qkv_bias: bool = False

    def n_params(self) -> int:
        """The published model's parameters, by formula.
        GPT-2: (V + T)·C + L·(4·C² + 2·C·I + 9·C + I) + 2·C, head tied (T: n_positions; with
        I = 4C a layer is 12·C² + 13·C); untied (`tie_word_embeddings` false) V·C more.
        Llama: `companion.estimate.llama_params` (V·C + L·(2·C + 2·C·(h·d) + 2·C·(kv·d) +
        3·C·I) + C + V·C untied, d = C / h; q, k, v biases h·d + 2·kv·d per layer)."""
        V, C, L, I = self.vocab, self.width, self.depth, self.intermediate
        if self.family == "gpt2":
            return ((V + self.max_seq_len) * C + L * (4 * C * C + 2 * C * I + 9 * C + I) + 2 * C
                    + (0 if self.tied else V * C))
        return llama_params(V, C, L, self.heads, kv_heads=self.kv_heads, intermediate=I,
                            tied=self.tied, qkv_bias=self.qkv_bias)

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
                                     rope_theta=self.rope_theta, norm_eps=self.norm_eps)
        if self.intermediate != 4 * self.width:
            raise ValueError(f"{self.name}: the course GPT's MLP is 4 x n_embd = "
                             f"{4 * self.width} wide, this config's n_inner is "
                             f"{self.intermediate}; it can be counted but not built")
        return functools.partial(GPT, self.vocab, T, self.width, self.depth, self.heads,
                                 fused_attention=True, tie_head=self.tied)

    def _seq_len(self, seq_len: int | None) -> int:
        seq_len = seq_len or self.max_seq_len
        if seq_len > self.max_seq_len:
            raise ValueError(f"{self.name} takes at most {self.max_seq_len} tokens, got "
                             f"seq_len={seq_len}")
        return seq_len


def _get(config: dict, key: str, where: str):
    if config.get(key) is None:
        raise ValueError(f"{where}: the config has no {key!r}; add it (see the model's "
                         "config.json on the Hugging Face Hub)")
    return config[key]


def _gpt2(config: dict, name: str) -> ModelConfig:
    C, heads = _get(config, "n_embd", name), _get(config, "n_head", name)
    return ModelConfig(name, "gpt2", _get(config, "vocab_size", name), C,
                       _get(config, "n_layer", name), heads, heads,
                       config.get("n_inner") or 4 * C,
                       bool(config.get("tie_word_embeddings", True)),   # GPT-2's default
                       _get(config, "n_positions", name),
                       norm_eps=config.get("layer_norm_epsilon", 1e-5))


def _llama(config: dict, name: str) -> ModelConfig:
    heads, C = _get(config, "num_attention_heads", name), _get(config, "hidden_size", name)
    if config.get("head_dim") not in (None, C // heads):
        raise ValueError(f"{name}: head_dim {config['head_dim']} differs from hidden_size / "
                         f"num_attention_heads = {C // heads}; companion.models.Llama supports "
                         "only head_dim = hidden_size / heads")
    return ModelConfig(name, "llama", _get(config, "vocab_size", name), C,
                       _get(config, "num_hidden_layers", name), heads,
                       config.get("num_key_value_heads") or heads,
                       _get(config, "intermediate_size", name),
                       bool(config.get("tie_word_embeddings", False)),
                       _get(config, "max_position_embeddings", name),
                       rope_theta=float(config.get("rope_theta", 10000.0)),
                       norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                       qkv_bias=config["model_type"] == "qwen2"
                       or bool(config.get("attention_bias")))


def from_dict(config: dict, *, name: str = "config") -> ModelConfig:
    """A ModelConfig from a parsed config.json; `name` says where it came from in errors."""
    kind = config.get("model_type")
    if kind == "gpt2":
        return _gpt2(config, name)
    if kind in _LLAMA_TYPES:
        return _llama(config, name)
    raise ValueError(f"{name}: model_type {kind!r} is not supported; supported: gpt2, "
                     + ", ".join(_LLAMA_TYPES))


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
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
