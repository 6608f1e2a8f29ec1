"""Read a Hugging Face `config.json` without `transformers`: the sizes the planner needs.

GPT-2 (`n_embd`, `n_layer`, `n_head`, `n_positions`, `vocab_size`, `n_inner`; head tied to the
embedding) and the Llama family (Llama, Mistral, Qwen2: `hidden_size`, `num_hidden_layers`,
`num_attention_heads`, `num_key_value_heads`, `intermediate_size`, `vocab_size`,
`max_position_embeddings`, `tie_word_embeddings`; Qwen2's q, k, v projections carry biases).
`SHIPPED` holds a few published configurations, written here from the models' config.json files
on the Hugging Face Hub (the Hub cannot be reached from the test machines); `n_params` is
checked against each model card's count in tests/test_plan_configs.py.

The planner builds GPT-2 shapes as the course's `companion.models.GPT` (whose head is untied and
has a bias: V·C + V more parameters than GPT-2's, said where it is printed). Llama shapes are
read and counted; the planner does not build them yet.

Example:
    >>> load_config("llama-3-8b").n_params()
    8030261248
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

__all__ = ["ModelConfig", "SHIPPED", "load_config", "from_dict", "shipped"]

SHIPPED = {
    # openai-community/gpt2-xl, config.json
    "gpt2-xl": {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 1600,
                "n_layer": 48, "n_head": 25, "n_inner": None},
    # meta-llama/Meta-Llama-3-8B, config.json
    "llama-3-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 8192, "rope_theta": 500000.0,
                   "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    # mistralai/Mistral-7B-v0.1, config.json
    "mistral-7b": {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 32768, "rope_theta": 10000.0,
                   "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    # Qwen/Qwen2.5-7B, config.json
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
                   "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4,
                   "max_position_embeddings": 131072, "rope_theta": 1000000.0,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}
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
    qkv_bias: bool = False

    def n_params(self) -> int:
        """The published model's parameters, by formula.
        GPT-2: (V + T)·C + L·(4·C² + 2·C·I + 9·C + I) + 2·C, head tied (T: n_positions; with
        I = 4C a layer is 12·C² + 13·C).
        Llama: V·C + L·(2·C + 2·C·(h·d) + 2·C·(kv·d) + 3·C·I) + C + V·C untied, d = C / h, and
        q, k, v biases (h·d + 2·kv·d per layer) for Qwen2."""
        V, C, L, I = self.vocab, self.width, self.depth, self.intermediate
        if self.family == "gpt2":
            return (V + self.max_seq_len) * C + L * (4 * C * C + 2 * C * I + 9 * C + I) + 2 * C
        d = C // self.heads
        attention = 2 * C * self.heads * d + 2 * C * self.kv_heads * d
        bias = (self.heads * d + 2 * self.kv_heads * d) if self.qkv_bias else 0
        return V * C + L * (2 * C + attention + bias + 3 * C * I) + C + (0 if self.tied else V * C)

    def model_fn(self, seq_len: int | None = None):
        """A function of dtype= and device= that builds the model for the planner."""
        from companion.models import GPT
        seq_len = seq_len or self.max_seq_len
        if seq_len > self.max_seq_len:
            raise ValueError(f"{self.name} takes at most {self.max_seq_len} tokens, got "
                             f"seq_len={seq_len}")
        if self.family != "gpt2":
            raise ValueError(f"{self.name} is a Llama-shaped model ({self.n_params():,} "
                             "parameters): the planner reads and counts it, but builds and "
                             "simulates only GPT-2 shapes (the course GPT) so far")
        if self.intermediate != 4 * self.width:
            raise ValueError(f"{self.name}: the course GPT has a 4C MLP, this config "
                             f"{self.intermediate}")
        return functools.partial(GPT, self.vocab, seq_len, self.width, self.depth, self.heads,
                                 fused_attention=True)


def _get(config: dict, key: str, where: str):
    if key not in config or config[key] is None:
        raise ValueError(f"{where}: the config has no {key!r}")
    return config[key]


def from_dict(config: dict, *, name: str = "config") -> ModelConfig:
    """A ModelConfig from a parsed config.json."""
    kind = config.get("model_type")
    if kind == "gpt2":
        C = _get(config, "n_embd", name)
        return ModelConfig(name, "gpt2", _get(config, "vocab_size", name), C,
                           _get(config, "n_layer", name), _get(config, "n_head", name),
                           _get(config, "n_head", name), config.get("n_inner") or 4 * C, True,
                           _get(config, "n_positions", name))
    if kind in _LLAMA_TYPES:
        heads = _get(config, "num_attention_heads", name)
        C = _get(config, "hidden_size", name)
        if config.get("head_dim") not in (None, C // heads):
            raise ValueError(f"{name}: head_dim {config['head_dim']} != hidden_size / heads is "
                             "not supported")
        return ModelConfig(name, "llama", _get(config, "vocab_size", name), C,
                           _get(config, "num_hidden_layers", name), heads,
                           config.get("num_key_value_heads") or heads,
                           _get(config, "intermediate_size", name),
                           bool(config.get("tie_word_embeddings", False)),
                           _get(config, "max_position_embeddings", name),
                           qkv_bias=kind == "qwen2" or bool(config.get("attention_bias")))
    raise ValueError(f"{name}: model_type {kind!r} is not supported; supported: gpt2, "
                     + ", ".join(_LLAMA_TYPES))


def shipped() -> list[str]:
    """The names `load_config` knows without a file."""
    return sorted(SHIPPED)


def load_config(name_or_path: str | pathlib.Path) -> ModelConfig:
    """A shipped model by name (case-insensitive), or a config.json by path."""
    key = str(name_or_path).lower()
    if key in SHIPPED:
        return from_dict(SHIPPED[key], name=key)
    path = pathlib.Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ValueError(f"no file {path}")
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        return from_dict(config, name=path.name)
    raise ValueError(f"unknown model {name_or_path!r}: give a config.json path or one of "
                     + ", ".join(shipped()))
