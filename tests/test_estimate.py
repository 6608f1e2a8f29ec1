"""companion.estimate: published per-parameter figures, ZeRO's worked example, and predictions held
against what companion.memory.track measures on the course's models."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from companion import estimate as E
from companion.memory import measure, track
from companion.models import GPT, MLP, Block, make_classification, make_tokens


@pytest.mark.parametrize("optimizer, precision, options, per_param", [
    ("adam", "mixed", {}, 16),                          # ZeRO paper: 2 + 2 + K, K = 12
    ("adamw", "mixed", {"fp32_grads": True}, 18),       # Hugging Face's anatomy: fp32 gradients
    ("adam", "mixed", {"fp32_grad_buffer": True}, 20),  # Ultra-Scale Playbook: + fp32 buffer
    ("adam", "fp32", {}, 16),
    ("adam", "bf16", {}, 8),
    ("adam", "bf16", {"fp32_grad_buffer": True}, 12),
    ("sgd", "fp32", {}, 8),
    ("sgd_momentum", "fp32", {}, 12),
    ("sgd", "mixed", {}, 8),                            # the fp32 master copy is optimizer state
    ("sgd_momentum", "mixed", {}, 12),
    ("adam", "autocast", {}, 16),                       # torch.amp: fp32 weights, grads, states
])
def test_bytes_per_parameter(optimizer, precision, options, per_param):
    states = E.model_states(1000, optimizer=optimizer, precision=precision, **options)
    assert states.total == per_param * 1000


def test_the_fp32_buffer_sits_beside_the_16_bit_gradients():
    states = E.model_states(1000, precision="mixed", fp32_grad_buffer=True)
    assert (states.params, states.grads, states.optimizer) == (2000, 6000, 12000)
    sharded = E.model_states(1000, precision="mixed", fp32_grad_buffer=True, zero_stage=2,
                             world_size=4)
    assert sharded.grads == 6 * 250                      # stage 2 shards the buffer with them


@pytest.mark.parametrize("kwargs", [{"precision": "fp32"}, {"precision": "autocast"},
                                    {"precision": "mixed", "fp32_grads": True}])
def test_the_fp32_buffer_needs_16_bit_gradients(kwargs):
    with pytest.raises(ValueError, match="fp32_grad_buffer"):
        E.model_states(1000, fp32_grad_buffer=True, **kwargs)


def test_zero_paper_gpt2_and_figure_1():
    assert E.model_states(1.5e9, precision="mixed").total == 24 * 10**9  # "at least 24GB"
    psi, gb = 7.5e9, 10**9                              # written as the paper writes it
    totals = [E.model_states(psi, precision="mixed", zero_stage=s, world_size=64).total / gb
              for s in range(4)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]     # Figure 1, N_d = 64
    assert E.model_states(psi) == E.model_states(7_500_000_000)


@pytest.mark.parametrize("n", [7.5e9 + 0.5, 0.5, float("nan"), float("inf"), "7.5e9", None])
def test_a_parameter_count_must_be_whole(n):
    with pytest.raises(ValueError, match="n_params"):
        E.model_states(n)


def test_a_numpy_integer_is_a_parameter_count_but_a_bool_is_not():
    np = pytest.importorskip("numpy")
    assert E.model_states(np.int64(7)) == E.model_states(7)
    assert isinstance(E.model_states(np.int32(7)).params, int)
    for n in (True, np.float32(7.0)):
        with pytest.raises(ValueError, match=f"n_params must be a number of parameters.*got "
                                             f"{type(n).__name__}"):
            E.model_states(n)


def test_zero_shards_only_what_its_stage_says():
    base = E.model_states(1000, precision="mixed")
    s1, s2, s3 = (E.model_states(1000, precision="mixed", zero_stage=s, world_size=4)
                  for s in (1, 2, 3))
    assert (s1.params, s1.grads, s1.optimizer) == (base.params, base.grads, base.optimizer // 4)
    assert (s2.params, s2.grads) == (base.params, base.grads // 4)
    assert s3.params == base.params // 4
    uneven = E.model_states(10, zero_stage=3, world_size=3)           # ceil(10 / 3) = 4 per rank
    assert uneven.params == 16


@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 10**9), world=st.integers(1, 512),
       optimizer=st.sampled_from(E.OPTIMIZERS), precision=st.sampled_from(E.PRECISIONS))
def test_each_stage_saves_or_keeps(n, world, optimizer, precision):
    totals = [E.model_states(n, optimizer=optimizer, precision=precision, zero_stage=s,
                             world_size=world).total for s in range(4)]
    assert totals == sorted(totals, reverse=True)
    assert E.model_states(n, optimizer=optimizer, precision=precision, zero_stage=3,
                          world_size=1).total == totals[0]


@pytest.mark.parametrize("kwargs", [{"optimizer": "lion"}, {"precision": "fp8"}, {"zero_stage": 4},
                                    {"world_size": 0}, {"world_size": 2.5}])
def test_bad_options_say_what_is_allowed(kwargs):
    with pytest.raises(ValueError):
        E.model_states(100, **kwargs)
    with pytest.raises(ValueError):
        E.model_states(-1)


@pytest.mark.parametrize("opt_name, make_opt", [
    ("adam", lambda p: torch.optim.Adam(p)),
    ("sgd_momentum", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
])
@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
def test_model_states_match_torch_optimizers(opt_name, make_opt, dtype, precision):
    def step():
        model = MLP(13, 40, 3, 5, dtype=dtype)
        opt = make_opt(model.parameters())
        X, y = make_classification(16, 13, 5, dtype=dtype)
        model.loss(X, y).backward()
        opt.step()
        return model, opt

    end = measure(step).breakdown("current")
    n = E.mlp_params(13, 40, 3, 5)
    predicted = E.model_states(n, optimizer=opt_name, precision=precision)
    assert end["parameters"] == predicted.params and end["gradients"] == predicted.grads
    step_counters = 4 * 8 if opt_name == "adam" else 0             # one fp32 scalar per tensor
    assert end["optimizer_state"] == predicted.optimizer + step_counters


def test_parameter_counts_match_the_models():
    mlp = MLP(7, 33, 4, 3)
    assert sum(p.numel() for p in mlp.parameters()) == E.mlp_params(7, 33, 4, 3)
    gpt = GPT(vocab=50, seq_len=24, width=32, depth=3, heads=4)
    assert sum(p.numel() for p in gpt.parameters()) == E.gpt_params(50, 24, 32, 3)


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("B, D, W, L, K", [(32, 20, 64, 3, 10), (100, 7, 33, 5, 3), (1, 4, 8, 1, 2)])
def test_mlp_activations_within_5_percent_of_measurement(dtype, precision, B, D, W, L, K):
    model = MLP(D, W, L, K, dtype=dtype)
    X, y = make_classification(B, D, K, dtype=dtype)
    with track("cpu") as t:
        loss = model.loss(X, y)                       # what stays live is what backward needs
    predicted = E.mlp_activations(B, W, L, K, precision=precision)
    saved = t.current - loss.untyped_storage().nbytes()   # the loss is an output, not saved
    assert abs(saved - predicted) <= 0.05 * predicted
    loss.backward()


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("B, T, C, L, H, V", [(3, 32, 48, 1, 4, 64), (2, 96, 32, 2, 2, 50),
                                              (5, 17, 24, 3, 3, 31)])
def test_gpt_activations_within_5_percent_of_measurement(dtype, precision, B, T, C, L, H, V):
    model = GPT(vocab=V, seq_len=T, width=C, depth=L, heads=H, dtype=dtype)
    x, y = make_tokens(B, T, vocab=V)
    with track("cpu") as t:
        loss = model.loss(x, y)
    predicted = E.gpt_activations(B, T, C, L, H, V, precision=precision)
    saved = t.current - loss.untyped_storage().nbytes()
    assert abs(saved - predicted) <= 0.05 * predicted
    assert t.breakdown("current")["activations"] >= 0.95 * predicted
    loss.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, D, W, L, K", [(32, 20, 64, 3, 10), (100, 7, 33, 5, 3), (1, 4, 8, 1, 2)])
def test_mlp_autocast_activations_within_5_percent_of_measurement(dtype, B, D, W, L, K):
    model = MLP(D, W, L, K)                           # fp32 model, 16-bit autocast
    X, y = make_classification(B, D, K)
    with track("cpu") as t:
        with torch.autocast("cpu", dtype=dtype):
            loss = model.loss(X, y)
    predicted = E.mlp_activations(B, W, L, K, precision="autocast", d_in=D)
    saved = t.current - loss.untyped_storage().nbytes()
    assert abs(saved - predicted) <= 0.05 * predicted
    loss.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T, C, L, H, V", [(3, 32, 48, 1, 4, 64), (2, 96, 32, 2, 2, 50),
                                              (5, 17, 24, 3, 3, 31), (32, 64, 64, 2, 4, 128)])
def test_gpt_autocast_activations_within_5_percent_of_measurement(dtype, B, T, C, L, H, V):
    model = GPT(vocab=V, seq_len=T, width=C, depth=L, heads=H)
    x, y = make_tokens(B, T, vocab=V)
    with track("cpu") as t:
        with torch.autocast("cpu", dtype=dtype):
            loss = model.loss(x, y)
    predicted = E.gpt_activations(B, T, C, L, H, V, precision="autocast")
    saved = t.current - loss.untyped_storage().nbytes()
    assert abs(saved - predicted) <= 0.05 * predicted
    assert t.breakdown("current")["activations"] >= 0.95 * predicted
    loss.backward()


def test_autocast_needs_d_in_for_the_mlp_and_a_known_device():
    with pytest.raises(ValueError, match="d_in"):
        E.mlp_activations(4, 8, 2, 3, precision="autocast")
    with pytest.raises(ValueError, match="device_type"):
        E.gpt_activations(2, 8, 16, 1, 2, 10, precision="autocast", device_type="tpu")


def test_cuda_autocast_keeps_softmax_in_fp32_and_saves_a_16_bit_copy():
    cpu, cuda = (E.gpt_activations(2, 64, 32, 3, 4, 50, precision="autocast", device_type=d)
                 for d in ("cpu", "cuda"))
    assert cuda - cpu == 3 * 4 * 2 * 4 * 64 * 64      # depth · (6 - 2) bytes · B·heads·T²


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt_autocast_activations_on_cuda():
    B, T, C, L, H, V = 4, 64, 64, 2, 4, 100
    model = GPT(vocab=V, seq_len=T, width=C, depth=L, heads=H, device="cuda")
    x, y = (t.cuda() for t in make_tokens(B, T, vocab=V))
    with track("cuda") as t:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model.loss(x, y)
    predicted = E.gpt_activations(B, T, C, L, H, V, precision="autocast", device_type="cuda")
    assert abs(t.breakdown("current")["activations"] - predicted) <= 0.05 * predicted


def test_autocast_model_states_are_fp32_measured():
    model = MLP(13, 40, 3, 5)
    opt = torch.optim.Adam(model.parameters())
    X, y = make_classification(16, 13, 5)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(X, y)
        loss.backward()
        opt.step()

    end = measure(step).breakdown("current")
    predicted = E.model_states(E.mlp_params(13, 40, 3, 5), precision="autocast")
    assert predicted.total == 16 * E.mlp_params(13, 40, 3, 5)
    assert end["gradients"] == predicted.grads
    assert end["optimizer_state"] == predicted.optimizer + 4 * 8      # + Adam's step counters


def _dropout(t):
    """Dropout as CUDA runs it (and Megatron-LM counts it): a 1-byte bool mask saved."""
    return torch.native_dropout(t, 0.1, True)[0]


class _DropoutBlock(Block):
    """The course's block with Megatron-LM's dropouts: after softmax, after the attention's
    output Linear, after the MLP."""

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=2))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.heads))
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
        weights = _dropout(scores.masked_fill(mask, float("-inf")).softmax(dim=-1))
        return _dropout(self.proj((weights @ v).transpose(1, 2).reshape(B, T, C)))

    def forward(self, x):
        x = x + self.attention(self.ln1(x))
        return x + _dropout(self.out(F.gelu(self.fc(self.ln2(x)))))


def _saved_bf16_gpt(B, T, C, L, H, V, dropout):
    """Bytes a bf16 GPT (with dropout: Megatron-style) saves, its loss in fp32."""
    model = GPT(V, T, C, L, H, dtype=torch.bfloat16)
    if dropout:
        model.blocks = torch.nn.Sequential(*[_DropoutBlock(C, H, dtype=torch.bfloat16)
                                             for _ in range(L)])
    x, y = make_tokens(B, T, vocab=V)
    with track("cpu") as t:
        h = model.tok(x) + model.pos(torch.arange(T))
        h = _dropout(h) if dropout else h
        logits = model.head(model.ln(model.blocks(h)))
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        del logits                                    # the loss does not keep the bf16 logits
    return t.current - loss.untyped_storage().nbytes()


@pytest.mark.parametrize("dropout", [True, False])
@pytest.mark.parametrize("B, T, C, L, H, V", [(3, 32, 48, 1, 4, 64), (2, 40, 32, 2, 2, 50),
                                              (5, 17, 24, 3, 3, 31)])
def test_korthikanti_formula_matches_measurement_to_the_byte(dropout, B, T, C, L, H, V):
    """sbh(34 + 5as/h) per layer with dropout, sbh(32 + 2as/h) without; what the paper leaves out
    is exactly LayerNorm's mean and rstd (8 bytes per token per LayerNorm pair), the causal mask
    (T² bytes per layer), the position indices (8T) and the loss's one-value weight (4)."""
    N = B * T
    left_out = L * (8 * N + T * T) + 4 * N + 8 * T + 4
    predicted = E.transformer_activations(B, T, C, L, H, V, dropout=dropout)
    assert _saved_bf16_gpt(B, T, C, L, H, V, dropout) == predicted + left_out


def test_korthikanti_per_layer_terms():
    s, b, h, a = 1024, 8, 1600, 25
    assert E.transformer_layer_activations(b, s, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert E.transformer_layer_activations(b, s, h, a, dropout=False) == \
        s * b * h * (32 + 2 * a * s // h)
    two = E.transformer_activations(b, s, h, 2, a, 50257)
    one = E.transformer_activations(b, s, h, 1, a, 50257)
    assert two - one == E.transformer_layer_activations(b, s, h, a)


def test_cpu_dropout_keeps_a_mask_in_the_activation_dtype():
    """F.dropout on CPU multiplies by a mask of the input's dtype (2 bytes in bf16); CUDA's fused
    kernel (native_dropout) keeps a 1-byte bool mask, which is what the paper counts."""
    x = torch.randn(1000, dtype=torch.bfloat16, requires_grad=True)
    for fn, mask_bytes in [(lambda t: F.dropout(t, 0.1), 2000), (_dropout, 1000)]:
        with track("cpu") as t:
            y = fn(x)
        assert t.current - y.untyped_storage().nbytes() == mask_bytes


def test_bf16_course_gpt_is_the_formula_without_dropout():
    B, T, C, L, H, V = 4, 24, 32, 2, 4, 40
    course = E.gpt_activations(B, T, C, L, H, V, precision="bf16")
    N = B * T
    # the course's bf16 loss keeps a bf16 log-softmax (2NV) where the formula has fp32 (4NV)
    assert course == (E.transformer_activations(B, T, C, L, H, V, dropout=False) - 2 * N * V
                      + L * (8 * N + T * T) + 4 * N + 8 * T + 2)


def test_activations_grow_linearly_in_batch_and_quadratically_in_sequence():
    a = [E.gpt_activations(b, 64, 64, 2, 4, 100) for b in (1, 2, 4)]
    assert a[2] - a[1] == 2 * (a[1] - a[0])
    per_t = [E.gpt_activations(1, t, 64, 2, 4, 100) for t in (128, 256, 512)]
    assert (per_t[2] - per_t[1]) > 2 * (per_t[1] - per_t[0])


def test_gpt_shape_recovers_gpt2_small_width():
    n = E.gpt_params(50257, 1024, 768, 12)
    assert E.gpt_shape(n) == {"width": 768, "depth": 12, "heads": 12, "vocab": 50257}


def test_training_memory_adds_states_and_activations():
    shape = {"width": 64, "depth": 2, "heads": 4, "vocab": 100}
    n = E.gpt_params(100, 32, 64, 2)
    parts = E.training_memory(n, batch=8, seq_len=32, precision="mixed", optimizer="adam",
                              zero_stage=2, world_size=4, shape=shape)
    states = E.model_states(n, precision="mixed", zero_stage=2, world_size=4)
    assert (parts["parameters"], parts["gradients"], parts["optimizer_state"]) == (
        states.params, states.grads, states.optimizer)
    assert parts["activations"] == E.gpt_activations(8, 32, 64, 2, 4, 100, precision="mixed")


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_training_memory_passes_the_device_type_to_autocast_activations(device_type):
    shape = {"width": 64, "depth": 2, "heads": 4, "vocab": 100}
    n = E.gpt_params(100, 256, 64, 2)
    parts = E.training_memory(n, batch=4, seq_len=256, precision="autocast", shape=shape,
                              device_type=device_type)
    assert parts["activations"] == E.gpt_activations(4, 256, 64, 2, 4, 100, precision="autocast",
                                                     device_type=device_type)
    assert parts["parameters"] + parts["gradients"] + parts["optimizer_state"] == 16 * n


def test_memory_calculator_shows_the_estimate(monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    monkeypatch.setattr("IPython.display.display", lambda *a, **k: None)
    from companion.widgets import memory_calculator

    box = memory_calculator(1e9, batch=4, seq_len=512, precision="fp32", gpu_bytes=80e9)
    summary = box.children[2]
    n = int(box.children[0].children[0].value)
    shape = E.gpt_shape(n, seq_len=512)
    parts = E.training_memory(n, batch=4, seq_len=512, precision="fp32", shape=shape)
    assert f"{sum(parts.values()) / 1e9:.1f} GB" in summary.value
    box.children[1].children[2].value = 3                     # ZeRO stage 3
    box.children[1].children[3].value = 64                    # over 64 GPUs
    sharded = E.training_memory(n, batch=4, seq_len=512, precision="fp32", zero_stage=3,
                                world_size=64, shape=shape)
    assert f"{sum(sharded.values()) / 1e9:.1f} GB" in summary.value
    assert sum(sharded.values()) < sum(parts.values())


# ---------------------------------------------------------------- offload_placement (chapter 08)

GiB = 2**30


@pytest.mark.parametrize("stage, optimizer, params, zero_init, host_gb, device_gb", [
    # DeepSpeed's docs (docs/code-docs/source/memory.rst), estimate_zero3_..._all_cold with
    # total_params=2851e6, largest_layer_params=32e6, 8 GPUs on 1 node: "per CPU | per GPU".
    (3, "cpu", "cpu", True, 71.69, 0.12),
    (3, "cpu", "cpu", False, 127.45, 0.12),
    (3, "cpu", None, True, 63.72, 0.78),
    (3, "cpu", None, False, 127.45, 0.78),
    (3, None, None, True, 1.43, 6.09),
    (3, None, None, False, 127.45, 6.09),
    # estimate_zero2_..._all_cold, same model and GPUs, offload_optimizer=cpu.
    (2, "cpu", None, True, 127.45, 5.31),
])
def test_deepspeed_documented_examples(stage, optimizer, params, zero_init, host_gb, device_gb):
    placed = E.offload_placement(2_851_000_000, zero_stage=stage, offload_optimizer=optimizer,
                                 offload_params=params, gpus_per_node=8,
                                 largest_layer_params=32_000_000, zero_init=zero_init)
    assert (round(placed.host / GiB, 2), round(placed.device / GiB, 2)) == (host_gb, device_gb)


def test_deepspeed_zero2_without_offload_follows_the_code_not_the_older_docs():
    # The docs' table prints 15.93 GB per GPU, from the older 4P + 16P/N; DeepSpeed's code has
    # computed 2P + int(18P/N) since PR #5099 (2024), and the CPU figure is 4P x 8 GPUs x 1.5.
    P = 2_851_000_000
    placed = E.offload_placement(P, zero_stage=2, gpus_per_node=8)
    assert placed.device == 2 * P + int(18 * P / 8)
    assert round((4 * P + 16 * P // 8) / GiB, 2) == 15.93
    assert round(placed.host / GiB, 2) == 127.45


def test_offload_placement_matches_deepspeed_itself():
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    for P, L, per_node, nodes, zero_init, b in [(1, 0, 1, 1, True, 1.5),
                                                (10**9, 5 * 10**7, 8, 2, False, 1.5),
                                                (123_456_789, 4321, 3, 5, True, 2.25)]:
        for cpu in (True, False):
            ours = E.offload_placement(P, zero_stage=2, offload_optimizer="cpu" if cpu else None,
                                       gpus_per_node=per_node, nodes=nodes, buffer_factor=b)
            host, device = stage_1_and_2.estimate_zero2_model_states_mem_needs(
                P, per_node, nodes, cpu, b)
            assert (ours.device, ours.host) == (device, host)
            for cpu_params in ((True, False) if cpu else (False,)):
                ours = E.offload_placement(
                    P, zero_stage=3, offload_optimizer="cpu" if cpu else None,
                    offload_params="cpu" if cpu_params else None, gpus_per_node=per_node,
                    nodes=nodes, largest_layer_params=L, zero_init=zero_init, buffer_factor=b)
                host, device, _ = stage3.estimate_zero3_model_states_mem_needs(
                    P, L, per_node, nodes, cpu, cpu_params, zero_init, b)
                assert (ours.device, ours.host) == (device, host)


@pytest.mark.parametrize("param_bytes, precision", [(4, "fp32"), (2, "mixed")])
def test_course_layout_without_offload_is_model_states(param_bytes, precision):
    placed = E.offload_placement(1000, zero_stage=0, convention="course", param_bytes=param_bytes)
    assert (placed.device, placed.host, placed.disk) == (
        E.model_states(1000, precision=precision).total, 0, 0)


@pytest.mark.parametrize("param_bytes, where, device, host, disk", [
    (4, "cpu", 4, 16, 0),         # weights | master 4 + gradients 4 + moments 8
    (2, "cpu", 2, 18, 0),         # ... + the 16-bit copy sent up
    (4, "nvme", 4, 4, 12),        # master and moments on disk, gradients on the host
    (2, "nvme", 2, 6, 12),
])
def test_course_layout_with_offload(param_bytes, where, device, host, disk):
    placed = E.offload_placement(1000, zero_stage=2, offload_optimizer=where, convention="course",
                                 param_bytes=param_bytes)
    assert (placed.device, placed.host, placed.disk) == (1000 * device, 1000 * host, 1000 * disk)
    # 20 bytes in all, 4 more than without offload: fp32 weights keep a second fp32 copy (the
    # master); 16-bit weights get fp32 gradients on the host and a 16-bit copy to send up.
    plain = E.model_states(1000, precision="fp32" if param_bytes == 4 else "mixed").total
    assert placed.device + placed.host + placed.disk == 20 * 1000 == plain + 4 * 1000


@pytest.mark.parametrize("kwargs, message", [
    ({"offload_optimizer": "nvme"}, "no NVMe case"),
    ({"zero_stage": 1}, "stages 2 and 3"),
    ({"offload_params": "cpu", "offload_optimizer": "cpu"}, "needs zero_stage=3"),
    ({"zero_stage": 3, "offload_params": "cpu"}, "together with the optimizer"),
    ({"offload_optimizer": "disk"}, 'None, "cpu" or "nvme"'),
    ({"convention": "mine"}, "convention must be"),
    ({"gpus_per_node": 0}, "gpus_per_node must be"),
    ({"n_params": -5}, "n_params must be"),
    ({"n_params": 1.5e9}, "n_params must be"),
    ({"buffer_factor": 0.5}, "buffer_factor"),
    ({"convention": "course", "gpus_per_node": 2}, "one device"),
    ({"convention": "course", "offload_params": "cpu", "offload_optimizer": "cpu"},
     "not parameters"),
    ({"convention": "course", "param_bytes": 3}, "param_bytes"),
    ({"convention": "course", "zero_stage": 4}, "zero_stage must be"),
])
def test_offload_placement_rejects_bad_arguments(kwargs, message):
    args = {"n_params": 1000, "zero_stage": 2} | kwargs
    with pytest.raises(ValueError, match=message):
        E.offload_placement(args.pop("n_params"), **args)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10**11), device=st.integers(0, 10**12), host=st.integers(0, 10**13),
       gpus=st.integers(1, 16), largest=st.integers(0, 10**9))
def test_choose_offload_takes_the_first_setting_that_fits(n, device, host, gpus, largest):
    chosen = E.choose_offload(n, device_budget=device, host_budget=host, gpus_per_node=gpus,
                              largest_layer_params=largest)
    fits = [s for s in E.OFFLOAD_LADDER
            if (p := E.offload_placement(n, **s, gpus_per_node=gpus, largest_layer_params=largest))
            .device <= device and p.host <= host]
    assert chosen == (fits[0] if fits else None)


def test_choose_offload_moves_down_the_ladder_as_the_gpu_shrinks():
    # 7B parameters, largest layer 1e8, 16 GPUs: per GPU 21.9, 14, 8.3, 1.3 and 0.4 GB.
    picks = [E.choose_offload(7 * 10**9, device_budget=int(gb * 10**9), host_budget=10**12,
                              gpus_per_node=16, largest_layer_params=10**8)
             for gb in (30, 20, 10, 2, 1, 0.1)]
    settings = [p and (p["zero_stage"], p["offload_optimizer"], p["offload_params"]) for p in picks]
    assert settings == [(2, None, None), (2, "cpu", None), (3, None, None), (3, "cpu", None),
                        (3, "cpu", "cpu"), None]


def test_fp32_course_gpt_is_the_formula_at_four_bytes_a_value():
    B, T, C, L, H, V = 4, 24, 32, 2, 4, 40
    course = E.gpt_activations(B, T, C, L, H, V, precision="fp32")
    N = B * T
    # left out by the paper: LayerNorm statistics (2 per LayerNorm per token) and the mask
    assert course == (E.transformer_activations(B, T, C, L, H, V, dropout=False, precision="fp32")
                      + L * (T * T + 4 * 4 * N) + 2 * 4 * N + 8 * T + 4)
    assert E.transformer_layer_activations(B, T, C, H, precision="fp32") == (
        N * C * (64 + 2) + H * T * T * B * (8 + 1))           # masks stay one byte
    with pytest.raises(ValueError, match="precision"):
        E.transformer_activations(B, T, C, L, H, V, precision="int8")


def test_training_memory_needs_a_shape_or_reads_it_off_the_model():
    from companion.models import GPT
    with pytest.raises(ValueError, match="shape is required"):
        E.training_memory(932608, batch=8, seq_len=64)
    with pytest.raises(ValueError, match="missing heads"):
        E.training_memory(932608, batch=8, seq_len=64, shape={"width": 8, "depth": 1, "vocab": 9})
    with pytest.raises(TypeError, match="simulate the step"):
        E.training_memory(932608, batch=8, seq_len=64, shape=torch.nn.Linear(2, 2))
    model = GPT(64, 32, 48, 2, 4)
    shape = {"width": 48, "depth": 2, "heads": 4, "vocab": 64}
    n = sum(p.numel() for p in model.parameters())
    assert E.training_memory(n, batch=2, seq_len=32, shape=model) == E.training_memory(
        n, batch=2, seq_len=32, shape=shape)
    with_dropout = E.training_memory(n, batch=2, seq_len=32, shape=shape, dropout=True,
                                     precision="mixed")
    assert with_dropout["activations"] == E.transformer_activations(2, 32, 48, 2, 4, 64)


@pytest.mark.parametrize("V,T,C,L,H,B", [(512, 64, 128, 4, 4, 8), (50257, 1024, 768, 12, 12, 4),
                                         (50257, 1024, 1280, 24, 20, 2)])
def test_training_peak_is_what_is_alive_at_the_simulated_peak(V, T, C, L, H, B):
    """Against the step itself (fake tensors: GPT-2 small and large need no memory here), where
    adding every kind up misses by 5-11% either way."""
    from functools import partial
    from companion.models import GPT
    from companion.plan import Candidate, simulate
    shape = {"width": C, "depth": L, "heads": H, "vocab": V}
    n = E.gpt_params(V, T, C, L)
    measured = simulate(partial(GPT, V, T, C, L, H), Candidate(B))
    got = E.training_peak(n, batch=B, seq_len=T, optimizer="adamw", shape=shape)
    assert got["phase"] == measured.peak_phase == "backward"
    assert abs(got["peak"] - measured.peak) <= 1e-4 * measured.peak
    summed = sum(E.training_memory(n, batch=B, seq_len=T, optimizer="adamw", shape=shape).values())
    assert abs(summed - measured.peak) >= 0.04 * measured.peak
    accumulating = E.training_peak(n, batch=B, seq_len=T, optimizer="adamw", shape=shape,
                                   accumulation=2)
    assert accumulating["gradients"] == 4 * n and accumulating["peak"] > got["peak"]


def _saved_by_llama(B, T, C, L, H, KV, I, V, dtype, *, fake=True):
    """Bytes `Llama.loss` keeps at the end of forward, less the loss itself, and those the
    tracker files under activations; built on fake tensors (no memory) unless fake=False."""
    from contextlib import nullcontext
    from torch._subclasses import FakeTensorMode
    from companion.models import Llama
    with FakeTensorMode() if fake else nullcontext():
        model = Llama(V, T, C, L, H, kv_heads=KV, intermediate=I, dtype=dtype)
        x, y = torch.randint(V, (B, T)), torch.randint(V, (B, T))
        with track("cpu") as t:
            loss = model.loss(x, y)
        return t.current - loss.untyped_storage().nbytes(), t.breakdown("current")["activations"]


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16")])
@pytest.mark.parametrize("B, T, C, L, H, KV, I, V", [(3, 17, 24, 2, 6, 2, 40, 31),
                                                     (2, 12, 32, 3, 4, 4, 56, 50),
                                                     (5, 9, 40, 1, 10, 5, 72, 19)])
def test_llama_activations_are_the_simulated_forward_to_the_byte(dtype, precision, B, T, C, L,
                                                                 H, KV, I, V):
    predicted = E.llama_activations(B, T, C, L, H, V, kv_heads=KV, intermediate=I,
                                    precision=precision)
    assert _saved_by_llama(B, T, C, L, H, KV, I, V, dtype) == (predicted, predicted)


def test_llama_activations_on_fake_tensors_are_those_of_real_ones():
    sizes = (3, 17, 24, 2, 6, 2, 40, 31)
    assert _saved_by_llama(*sizes, torch.float32, fake=False) == \
        _saved_by_llama(*sizes, torch.float32)


def test_llama_activation_terms():
    """Per block in fp32 on the CPU, in values: 6·N·C for the two RMSNorms (input, x·rstd and
    output each) and 2·N rstds, 4·N·C for q, k, v and SDPA's output when kv_heads = heads,
    4·N·I for SwiGLU, and the log-sum-exp; fewer kv_heads shrink k and v only. In 16 bits on
    CUDA a norm keeps its 2·N·C-byte input where the CPU keeps 8·N·C of fp32 input and x·rstd."""
    B, T, C, L, H, V, I = 2, 64, 128, 4, 8, 1000, 320
    N = B * T
    full = E.llama_activations(B, T, C, L, H, V, kv_heads=H, intermediate=I)
    one_more = E.llama_activations(B, T, C, L + 1, H, V, kv_heads=H, intermediate=I)
    assert one_more - full == 4 * (6 * N * C + 2 * N + 4 * N * C + 4 * N * I) + 4 * B * H * T
    grouped = E.llama_activations(B, T, C, L, H, V, kv_heads=2, intermediate=I)
    assert full - grouped == L * 4 * 2 * N * (C - 2 * C // H)        # k and v
    cpu, cuda = (E.llama_activations(B, T, C, L, H, V, kv_heads=2, intermediate=I,
                                     precision="bf16", device_type=d) for d in ("cpu", "cuda"))
    assert cpu - cuda == (2 * L + 1) * (8 * N * C - 2 * N * C)
    with pytest.raises(ValueError, match="simulate the step"):
        E.llama_activations(B, T, C, L, H, V, kv_heads=2, intermediate=I, precision="autocast")
    with pytest.raises(ValueError, match="device_type"):
        E.llama_activations(B, T, C, L, H, V, kv_heads=2, intermediate=I, device_type="tpu")
