"""The models the course trains and their data, deterministic given a seed.

`MLP` (Linear-ReLU stacks, `mlp`), `GPT` (a small GPT-style decoder whose attention can be written
out, `gpt`) and `Llama` (RMSNorm, rotary positions, grouped-query attention, SwiGLU, `llama`) are
plain `nn.Module`s with no dropout, so a seed fixes every number. `make_classification` and
`make_tokens` make data for them; `make_regression` is chapter 01's linear-regression data
(`data`).

Example:
    >>> model = GPT(vocab=64, seq_len=32, width=48, depth=2, heads=4, seed=0)
    >>> x, y = make_tokens(8, 32, vocab=64, seed=0)
    >>> loss = model.loss(x, y)
"""
from companion.models.data import make_classification, make_regression, make_tokens
from companion.models.gpt import ATTENTIONS, GPT, Block
from companion.models.llama import Llama, LlamaBlock, Rotary, llama_intermediate
from companion.models.mlp import MLP

__all__ = ["make_regression", "MLP", "GPT", "make_classification", "make_tokens", "ATTENTIONS",
           "Block", "Llama", "LlamaBlock", "Rotary", "llama_intermediate"]
