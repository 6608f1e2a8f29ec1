"""Pick the device to run on, describe the machine, and size experiments to fit it.

Every notebook measures on the learner's own hardware. On a CPU the course must run in minutes, so
experiments use small sizes; on a GPU they use sizes where the memory effects are large and clear.
`sizes()` is the one place those numbers live, so a chapter never hard-codes its own.

Example:
    >>> dev = pick_device()
    >>> s = sizes(dev)
    >>> s.batch, s.width
"""
from __future__ import annotations

import dataclasses
import pathlib
import platform
import subprocess

import torch

__all__ = ["pick_device", "describe", "cpu_model", "Sizes", "sizes", "sizes_for_memory", "gpu_class",
           "GPU_CLASSES_GB"]


def pick_device(prefer: str | None = None) -> torch.device:
    """The device to run on: `prefer` if given, else CUDA when present, else the CPU."""
    if prefer is not None:
        return torch.device(prefer)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def describe(device: torch.device | str | None = None) -> dict:
    """A short record of the machine: device name, its memory, torch version, Python, platform."""
    device = pick_device() if device is None else torch.device(device)
    info = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["name"] = props.name
        info["memory_bytes"] = props.total_memory
    else:
        info["name"] = cpu_model()
        info["threads"] = torch.get_num_threads()
    return info


CPUINFO = "/proc/cpuinfo"         # Linux's description of its CPUs, read by cpu_model


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 7B13"), from /proc/cpuinfo on Linux, sysctl on macOS, or
    the registry's string on Windows; the architecture ("x86_64") where none of them answers."""
    try:
        for line in pathlib.Path(CPUINFO).read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Experiment sizes for one kind of device. Fields are read by the notebooks and benchmarks."""

    batch: int        # examples per batch in training demos
    width: int        # hidden width of MLPs
    depth: int        # number of layers in deep-MLP demos
    seq_len: int      # sequence length for the GPT-style model
    n_examples: int   # size of generated data sets
    epochs: int       # passes over the data in training demos
    steps: int        # steps timed in measurements
    gpt_width: int = 64     # width of the GPT-style model (companion.models.GPT)
    gpt_depth: int = 2      # its number of transformer blocks
    gpt_heads: int = 4      # its attention heads
    vocab: int = 128        # its vocabulary size
    ckpt_depth: int = 16    # blocks of the deep MLP that chapter 04 checkpoints
    ckpt_batch: int = 256   # its batch (large enough that activations dominate)
    ckpt_gpt_depth: int = 8  # transformer blocks of the GPT-style stack that chapter 04 checkpoints
    ckpt_gpt_batch: int = 8  # its batch of sequences
    ddp_width: int = 512     # chapter 06's bucket experiment: an MLP of ddp_depth Linear layers
    ddp_depth: int = 32      # (32 MiB of gradients at 512 x 32: many buckets at every cap); its
    ddp_batch: int = 16      # rows per rank. Gloo ranks on the CPU on any machine: same on CUDA.
    zero_width: int = 512    # width of the MLP whose model states chapter 07 shards
    zero_depth: int = 4      # its Linear layers: about zero_depth · zero_width² parameters
    zero_batch: int = 8      # its rows per rank (few, so that model states dominate)
    zero_vocab: int = 16384  # rows of the one large matrix in chapter 07's balance demo
    offload_width: int = 256  # width of the GPT whose Adam states chapter 08 offloads
    offload_depth: int = 4    # its blocks: about 12 · depth · width² parameters
    offload_batch: int = 2    # its batch of sequences (few, so that model states dominate)
    act_offload_batch: int = 32  # batch of the course GPT (gpt_width, gpt_depth) whose
                                 # activations chapter 08 offloads
    amp_gpt_batch: int = 16   # batch of the course GPT whose states and activations chapter 05
                              # measures in fp32 and mixed precision
    amp_width: int = 128      # width of the MLP that chapter 05 trains in fp32, bf16 and fp16
    amp_depth: int = 4        # its hidden layers
    amp_batch: int = 256      # its micro-batch
    amp_accum: int = 4096     # micro-batches per update (amp_batch · amp_accum = 2^20 examples):
                              # each micro-step's loss is divided by it, as in accumulation
    amp_steps: int = 300      # its training steps
    amp_matmul: int = 1024    # side of the square matrices whose 16-bit matmul chapter 05 times
    anatomy_gpt_batch: int = 32  # batch of the course GPT (gpt_width, gpt_depth, vocab) whose
                                 # training step chapter 00 takes apart
    token_rows: int = 8       # sequences in each of the three padded micro-batches of the course
                              # GPT whose mean over tokens chapter 03 accumulates
    cap_width: int = 128      # the capstone's GPT (vocab, seq_len, gpt_heads as above): width,
    cap_depth: int = 4        # blocks,
    cap_batch: int = 16       # sequences per optimizer step (the effective batch a plan keeps),
    cap_budget: int = 8 * 2**20   # and the device bytes it must train in (chapter 09)
    attn_batch: int = 1       # chapter 10's attention sweep: batch, heads and head dimension of
    attn_heads: int = 4       # q, k, v (batch, heads, T, head_dim),
    attn_head_dim: int = 32
    attn_max_len: int = 16384        # the longest T our FlashAttention runs (powers of 2 from 256)
    attn_naive_max_len: int = 4096   # the longest T the written-out attention runs
    attn_gpt_len: int = 512   # the longest sequence of the course GPT (gpt_width, gpt_depth,
    attn_gpt_batch: int = 4   # vocab) whose step chapter 10 measures, and its batch
    remat_batch: int = 8      # chapter 12: sequences (seq_len) through one block of gpt_width
    loss_tokens: int = 256    # tokens whose loss over loss_vocab classes chapter 12 computes
    loss_vocab: int = 131072  # (a 128k vocabulary: Llama 3's is 128,256)
    tiled_tokens: int = 16384  # tokens through the course GPT block's MLP, plain and tiled
    offload_depth_long: int = 8  # blocks of the long-sequence GPT whose checkpoint inputs
                                 # chapter 12 offloads (4·seq_len tokens, width gpt_width / 4)
    tp_width: int = 64        # chapter 13's tensor-parallel block (companion.models.Block):
    tp_heads: int = 4         # width and heads (both divisible by the ranks t),
    tp_seq: int = 16          # its sequence (divisible by t, for sequence parallelism)
    tp_batch: int = 2         # and its batch of sequences
    cp_len: int = 256         # chapter 13's context-parallel attention: T (divisible by 2k),
    cp_heads: int = 4         # heads (divisible by k, for Ulysses), head dimension and batch
    cp_head_dim: int = 16     # of q, k, v (batch, heads, T, head_dim)
    cp_batch: int = 1
    pp_width: int = 512       # chapter 13's pipeline: an MLP of pp_depth layers of pp_width
    pp_depth: int = 8         # (10 classes) cut into one stage per rank,
    pp_batch: int = 128       # rows per micro-batch
    pp_micro_batches: int = 8  # and micro-batches per step
    ep_width: int = 64        # chapter 13's mixture of experts (companion.experts.MoE): width,
    ep_hidden: int = 256      # each expert MLP's hidden width,
    ep_experts: int = 8       # experts (divisible by the ranks W)
    ep_tokens: int = 1024     # and tokens (divisible by W), on gloo ranks on every machine


_SIZES = {
    "cpu": Sizes(batch=32, width=256, depth=8, seq_len=64, n_examples=512, epochs=20, steps=3),
    "cuda": Sizes(batch=64, width=4096, depth=24, seq_len=1024, n_examples=8192, epochs=50, steps=10,
                  gpt_width=1024, gpt_depth=12, gpt_heads=16, vocab=50257,
                  ckpt_depth=64, ckpt_batch=8192, ckpt_gpt_depth=16, ckpt_gpt_batch=8,
                  zero_width=8192, zero_depth=8, zero_batch=64, zero_vocab=262144,
                  offload_width=1536, offload_depth=16, offload_batch=1, act_offload_batch=8,
                  amp_gpt_batch=8, amp_width=1024, amp_depth=8, amp_batch=4096, amp_accum=256,
                  amp_steps=500, amp_matmul=8192, anatomy_gpt_batch=8, token_rows=2,
                  cap_width=1024, cap_depth=12, cap_batch=16, cap_budget=4 * 2**30,
                  attn_batch=4, attn_heads=16, attn_head_dim=64, attn_max_len=32768,
                  attn_gpt_len=4096, attn_gpt_batch=1, remat_batch=4, loss_tokens=4096,
                  tiled_tokens=131072, offload_depth_long=16, tp_width=1024, tp_heads=16,
                  tp_seq=1024, tp_batch=4, cp_len=8192, cp_heads=16, cp_head_dim=64,
                  cp_batch=1, pp_width=2048, pp_depth=8, pp_batch=512, pp_micro_batches=8),
}


# GPU classes by memory in GB (10⁹ bytes). "cuda" is the 80 GB reference, used by bigger GPUs too;
# tests/test_device.py holds every chapter's run (companion.record.fit) under 60% of each class.
_R = dataclasses.replace
_GPU_CLASSES = {80: _SIZES["cuda"]}
_GPU_CLASSES[40] = _R(_GPU_CLASSES[80], anatomy_gpt_batch=4, amp_gpt_batch=4, act_offload_batch=4,
                      ckpt_gpt_batch=4, ckpt_depth=32, ckpt_batch=4096, offload_width=1024,
                      cap_batch=8, token_rows=1, attn_batch=2, attn_gpt_len=2048)
_GPU_CLASSES[24] = _R(_GPU_CLASSES[40], width=2048, anatomy_gpt_batch=2, amp_gpt_batch=2,
                      act_offload_batch=2, ckpt_gpt_batch=2, ckpt_gpt_depth=12, zero_width=4096,
                      offload_depth=8, amp_matmul=4096, cap_batch=4, attn_batch=1)
_GPU_CLASSES[16] = _R(_GPU_CLASSES[24], depth=16, gpt_depth=8, anatomy_gpt_batch=1,
                      amp_gpt_batch=1, act_offload_batch=1, ckpt_gpt_batch=1, ckpt_gpt_depth=8,
                      ckpt_depth=32, ckpt_batch=2048, offload_width=768, cap_batch=2,
                      cap_budget=3 * 2**30, tiled_tokens=65536)
GPU_CLASSES_GB = tuple(sorted(_GPU_CLASSES))


def gpu_class(total_bytes: int) -> int | None:
    """The GPU class (16, 24, 40 or 80 GB) of a GPU with `total_bytes` of memory: the largest
    class it holds 90% of (a "16 GB" T4 reports 15.8·10⁹ bytes), or None under 14.4·10⁹."""
    if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes < 0:
        raise ValueError(f"total_bytes must be a non-negative int, got {total_bytes!r}")
    fits = [gb for gb in GPU_CLASSES_GB if total_bytes >= 0.9 * gb * 10**9]
    return max(fits) if fits else None


def sizes_for_memory(total_bytes: int) -> Sizes:
    """The sizes for a GPU with `total_bytes` of memory (`torch.cuda.get_device_properties(d)
    .total_memory`): its class's (`gpu_class`), or the CPU sizes below the smallest class."""
    gb = gpu_class(total_bytes)
    return _SIZES["cpu"] if gb is None else _GPU_CLASSES[gb]


def sizes(device: torch.device | str | None = None) -> Sizes:
    """The experiment sizes for `device` (the picked device when None): small on CPU; on a GPU,
    those of its memory class (`sizes_for_memory`). `sizes("cuda")` on a machine without CUDA
    gives the 80 GB reference sizes, so a notebook can print what a GPU would run."""
    device = pick_device() if device is None else torch.device(device)
    if device.type != "cuda":
        return _SIZES["cpu"]
    if not torch.cuda.is_available():
        return _SIZES["cuda"]
    return sizes_for_memory(torch.cuda.get_device_properties(device).total_memory)
