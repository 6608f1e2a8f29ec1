"""Hugging Face models built from their published configs, for docs/PRACTITIONERS.md: the
factories and steps a practitioner passes to `python -m companion plan --model FILE:FUNCTION`.
Needs `pip install -e .[hf]` (transformers). No weights are downloaded: the planner builds each
model on fake tensors, so only the config's shapes matter.

- `qwen3_06b`: Qwen3-0.6B (a model_type the planner's own configs do not read: the factory is the
  way in for any architecture transformers has);
- `small_llama`: an 8.3M-parameter Llama with grouped-query attention, small enough that
  `--check` runs its step for real on a laptop's CPU;
- `padded_step`: a fine-tuning step as people write it: right-padded batches, an attention mask,
  labels -100 on the padding, the loss Hugging Face computes from `labels`.
"""
from __future__ import annotations

import torch

SEQ_LEN = 512          # tokens per sequence in `padded_step` (the factories' models take any)


def qwen3_06b():
    """Qwen3-0.6B's architecture, from the values of Qwen/Qwen3-0.6B's config.json on the Hub
    (28 layers, hidden 1024, 16 query and 8 key-value heads of 128, MLP 3072, vocabulary 151,936,
    tied embeddings): 596,049,920 parameters."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_word_embeddings=True, attention_bias=False))


def small_llama():
    """A Llama with the shapes of a large one scaled down (grouped-query attention, SwiGLU,
    untied head): 6 layers, hidden 256, vocabulary 8,000: 8,252,672 parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=8000, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048))


def padded_step(model, batch: int) -> torch.Tensor:
    """One micro-batch of `batch` right-padded sequences of SEQ_LEN tokens (lengths from a
    quarter of SEQ_LEN to all of it), loss on the real tokens only."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (batch, SEQ_LEN), device=device)
    lengths = torch.randint(SEQ_LEN // 4, SEQ_LEN + 1, (batch, 1), device=device)
    mask = (torch.arange(SEQ_LEN, device=device) < lengths).long()
    labels = ids.masked_fill(mask == 0, -100)
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss
