"""The models of the practitioner's trial (../shared/reviews/practitioner.md, "What worked"), small:
five Hugging Face models from configs (a Llama with a padding mask, a tied Qwen2, a BERT
classifier, T5, ViT), Mixtral, and five written here (a custom autograd Function, top-1 routing
with `nonzero`, a dict output, keyword arguments, a ResNet-18 in channels_last). Each entry is
(factory, step(model, batch) -> loss); the factories take no arguments, as the planner wants."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

T = 32                                       # tokens per sequence
VOCAB = 256


def _ids(model, batch, vocab=VOCAB):
    return torch.randint(vocab, (batch, T), device=next(model.parameters()).device)


def padded_lm_step(model, batch):
    """Right-padded sequences, an attention mask, labels -100 on the padding."""
    ids = _ids(model, batch)
    lengths = torch.randint(T // 4, T + 1, (batch, 1), device=ids.device)
    mask = (torch.arange(T, device=ids.device) < lengths).long()
    return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=172,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=128))


def hf_qwen2_tied():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=172,
                                        num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=True))


def hf_bert_cls():
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, num_labels=3))


def bert_step(model, batch):
    ids = _ids(model, batch)
    labels = torch.randint(3, (batch,), device=ids.device)
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss


def hf_t5():
    from transformers import T5Config, T5ForConditionalGeneration
    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0))


def t5_step(model, batch):
    ids = _ids(model, batch)
    return model(input_ids=ids, labels=_ids(model, batch)).loss


def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification
    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=128, num_labels=10))


def vit_step(model, batch):
    device = next(model.parameters()).device
    return model(pixel_values=torch.randn(batch, 3, 32, 32, device=device),
                 labels=torch.randint(10, (batch,), device=device)).loss


def hf_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128))


def lm_step(model, batch):
    ids = _ids(model, batch)
    return model(input_ids=ids, labels=ids).loss


class _Square(torch.autograd.Function):
    """x² with its own backward (saves its input through ctx)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _Blocks(nn.Module):
    def __init__(self, width=64, depth=4, vocab=VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)


class CustomFunctionLM(_Blocks):
    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + _Square.apply(torch.tanh(layer(h)))
        return self.head(h)


class DictOutputLM(_Blocks):
    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = h + F.gelu(layer(h))
        return {"logits": self.head(h), "hidden": h}


class KwargsLM(_Blocks):
    """Takes an attention mask by keyword, as Hugging Face models do, and passes it down."""

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        keep = attention_mask.unsqueeze(-1).to(h.dtype) if attention_mask is not None else 1
        for layer in self.layers:
            h = h + F.gelu(layer(h)) * keep
        return self.head(h)


def kwargs_step(model, batch):
    ids = _ids(model, batch)
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class Top1MoE(nn.Module):
    """Each token goes to its highest-scoring expert: indices from `nonzero`, a shape that
    depends on the data."""

    def __init__(self, width=64, experts=4, vocab=VOCAB):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.emb(ids).flatten(0, 1)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(h[rows]))
        return self.head(h + out).unflatten(0, ids.shape)


def _basic(cin, cout, stride):
    down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else nn.Identity())
    return nn.ModuleDict({
        "body": nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                              nn.ReLU(), nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                              nn.BatchNorm2d(cout)),
        "down": down})


class ResNet18(nn.Module):
    """torchvision's ResNet-18 layout (11,689,512 parameters at 1,000 classes): written here,
    since torchvision's wheel does not import beside the CPU torch."""

    def __init__(self, classes=1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        widths, blocks, cin = [64, 128, 256, 512], [], 64
        for i, w in enumerate(widths):
            blocks += [_basic(cin, w, 1 if i == 0 else 2), _basic(w, w, 1)]
            cin = w
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = F.relu(b["body"](x) + b["down"](x))
        return self.fc(x.mean((2, 3)))


def resnet18_channels_last():
    return ResNet18().to(memory_format=torch.channels_last)


def image_step(model, batch):
    device = next(model.parameters()).device
    x = torch.randn(batch, 3, 64, 64, device=device).to(memory_format=torch.channels_last)
    return F.cross_entropy(model(x), torch.randint(1000, (batch,), device=device))


def token_step(model, batch):
    """Next-token loss, reading `logits` from a dict output."""
    ids = _ids(model, batch)
    out = model(ids)
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


HF = {"hf_llama": (hf_llama, padded_lm_step), "hf_qwen2_tied": (hf_qwen2_tied, lm_step),
      "hf_bert_cls": (hf_bert_cls, bert_step), "hf_t5": (hf_t5, t5_step),
      "hf_vit": (hf_vit, vit_step), "hf_mixtral": (hf_mixtral, lm_step)}
OWN = {"custom_function": (CustomFunctionLM, token_step), "moe_routing": (Top1MoE, token_step),
       "dict_output": (DictOutputLM, token_step), "kwargs_model": (KwargsLM, kwargs_step),
       "resnet18_channels_last": (resnet18_channels_last, image_step)}
ALL = {**HF, **OWN}
