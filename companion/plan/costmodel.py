"""The speeds the planner ranks plans by: one device's matmul, memory, host-link and network
bandwidths (`CostModel`), from a GPU's datasheet, a device type, or a calibrated profile. How a
plan's step time adds up from them is `predict.predict_seconds`."""
from __future__ import annotations

import dataclasses

__all__ = ["CostModel"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Speeds of one device, for ranking plans; only their ratios matter to the ranking.

    `for_gpu(name)`: a GPU of `companion.cost.gpus` (each number cited there): fp32 matmuls on the
    CUDA cores (PyTorch leaves TF32 off for matmuls by default since 1.12,
    `torch.backends.cuda.matmul.allow_tf32 = False`, pytorch/pytorch#67384) at their peak times
    `gpus.efficiency` (one large SGEMM's share, cited there), and bf16 on the tensor cores at
    their peak times `gpus.step_efficiency` for the setup (eager by default, as the course runs;
    `compiled=True` for torch.compile): the share of its peak a published whole step of that
    setup reached (eager FSDP on H100s: torchtitan's 0.367 of the FLOPs it ran, its selective
    recompute counted; a GeForce card, an A100: their own runs, cited there), so the step's
    non-matmul work and launches are inside that factor; HBM bandwidth
    for the optimizer; PCIe (one direction) to the host; NVLink (one direction, half the total
    NVIDIA quotes) between GPUs, or PCIe where there is none; 10 µs per layer and micro-batch
    of kernel launches (assumed: a CUDA launch costs a few µs and a block launches a few);
    communication that hides behind compute (`overlap` 1: NCCL runs on its own streams, FSDP
    prefetches the next unit's all-gather, `companion.zero.prefetch`). An offloaded AdamW runs
    on the host at `host_adam_rate` bytes/s when given (`--host-adam-rate`: time yours with
    `companion.cost.calibrate`), else at 25 GB/s (assumed for torch's AdamW on a server: its
    DRAM streams 100-200 GB/s at peak; DeepSpeedCPUAdam "is 5X–7X faster than the standard
    PyTorch implementation", DeepSpeed's ZeRO-Offload tutorial, docs/_tutorials/
    zero-offload.md). `sources` says where each speed came from (`describe()`).
    `for_device("cuda")` is `for_gpu("A100 40GB")`. The NVMe tier: 3 GB/s each way (assumed: a
    PCIe 4 NVMe drive writes 3-7 GB/s) and 0.1 ms per file's flush (assumed).
    `for_device("cpu")`: one core of the course's reference CPU (a 2-core AMD EPYC with AVX2,
    one thread, as the CPU notebooks run), measured (`plan.verify` and benchmarks/bench_plan.py
    check the ranking these give): 26 GFLOP/s, the rate a whole training step reaches
    (attention's kernel, GELU and LayerNorm included); 1.7 ms per layer and micro-batch (eager
    PyTorch's operators, forward and backward; more with `track` on, whose ledger sees each); 15
    GB/s memory and copies (host and device are the same RAM); the host AdamW at 12 GB/s; 1
    GB/s between processes (gloo; assumed); its disk 0.65 GB/s with 0.75 ms per file flushed;
    activation offload's saved tensors at 2.9 GB/s each way, the rate a training step measured
    (a tensor at a time, each copy a new host tensor and a new one back, no overlap), a fifth of
    the copy bandwidth. 16 bits as fast as fp32, because CPUs differ most
    there (without bf16 units a bf16 matmul is 10-60x slower: a bf16 autocast step of the
    capstone ran 7.3x the fp32 one on the reference CPU; with AMX several times faster): time
    yours as chapter 05 does and pass half_speedup, or calibrate. Other machines: `from_profile`
    uses what `companion.cost.calibrate` measured on yours.
    """

    flops: float                  # matmul FLOP/s in fp32
    half_speedup: float           # bf16 matmul speed over fp32
    layer_seconds: float          # fixed cost per layer and micro-batch (forward + backward)
    memory_bandwidth: float       # bytes/s the optimizer streams through on the device
    host_bandwidth: float         # bytes/s between device and host (offload's copies)
    network_bandwidth: float      # bytes/s a rank sends to the others
    host_memory_bandwidth: float = 10e9   # bytes/s an offloaded optimizer streams on the host
    disk_bandwidth: float = 3e9   # bytes/s the NVMe tier reads and writes its files
    disk_sync_seconds: float = 1e-4   # one file's flush (msync) to the disk, beyond its bytes
    activation_bandwidth: float | None = None   # bytes/s activation offload's saved tensors
                                  # move each way inside a step (None: host_bandwidth)
    adam8bit_rate: float | None = None   # parameters/s of the 8-bit Adam step, measured
                                  # (None: ADAM8BIT_BYTES a parameter at memory_bandwidth)
    adam8bit_tensor_seconds: float = 0.0   # and its cost per tensor (unfused operators)
    adapter_bandwidth: float | None = None   # bytes/s LoRA adapters' own passes reach (thin
                                  # matmuls, scale, add; None: memory_bandwidth)
    adapter_seconds: float = 0.0  # and their fixed cost per adapted Linear and micro-batch
    overlap: float = 0.0          # share of the link's time that can hide behind compute
                                  # (0: none, the course's ZeRO on gloo; 1: NCCL beside kernels)
    sources: tuple[tuple[str, str], ...] = ()   # (speed, where it came from), for the report

    def describe(self) -> list[str]:
        """One line per speed that has a source: what it is and where it came from."""
        return [f"{name}: {source}" for name, source in self.sources]

    @classmethod
    def for_gpu(cls, name: str, *, compiled: bool = False,
                host_adam_rate: float | None = None, world_size: int = 8) -> "CostModel":
        """The speeds of a GPU in `companion.cost.gpus` (see the class docstring); `compiled`:
        torch.compile's factor; `host_adam_rate`: the host AdamW's bytes/s (28 B a parameter
        read and written: fp32 weight, gradient, two moments), measured on yours; `world_size`:
        the GPUs a collective's ring spans, whose link `gpus.ring_link` gives (NVLink inside its
        domain, PCIe inside a server, the servers' network cards across them)."""
        from companion.cost import gpus

        g = gpus.gpu(name)
        fp32, fp32_source = g.fp32_flops * gpus.efficiency(g, "fp32")[0], gpus.efficiency(g, "fp32")[1]
        dtype = "bf16" if g.bf16_flops else "fp16"
        factor, setup = gpus.step_efficiency(g, compiled=compiled)
        half = g.flops(dtype) * factor
        over, link = gpus.ring_link(g, world_size)
        if host_adam_rate is not None and not host_adam_rate > 0:
            raise ValueError(f"host_adam_rate is bytes/s, a positive number; got {host_adam_rate!r}")
        host = (f"{host_adam_rate / 1e9:g} GB/s, given (--host-adam-rate)" if host_adam_rate
                else "25 GB/s, assumed for torch's AdamW on a server CPU (DeepSpeedCPUAdam is "
                     "5-7x faster than torch's, DeepSpeed's ZeRO-Offload tutorial); time "
                     "yours with companion.cost.calibrate and pass --host-adam-rate")
        sources = ((f"{dtype} matmuls", f"{half / 1e12:.0f} TFLOP/s = {factor:.3f} x "
                                        f"{g.flops(dtype) / 1e12:.1f} ({setup})"),
                   ("fp32 matmuls", f"{fp32 / 1e12:.1f} TFLOP/s ({fp32_source})"),
                   ("host AdamW", host),
                   ("communication", "none: one GPU" if world_size == 1 else
                    f"a ring of {world_size} over {over} at {link / 1e9:.0f} GB/s one way "
                    "(gpus.ring_link); hidden behind compute where it can be (FSDP prefetches "
                    "one unit's all-gather; gradients reduced as backward makes them); the rest "
                    "is exposed"))
        return cls(fp32, half / fp32, 10e-6, g.hbm_bandwidth, g.pcie_bandwidth, link,
                   host_adam_rate or 25e9, overlap=1.0, sources=sources)

    @classmethod
    def for_device(cls, device_type: str) -> "CostModel":
        """The speeds of the class docstring for "cuda" (an A100 40GB) or "cpu"."""
        if device_type == "cuda":
            return cls.for_gpu("A100 40GB")
        if device_type == "cpu":
            # measured on the reference CPU, one thread (benchmarks/bench_plan.py):
            # - 26e9: the capstone's plain step (16 x 64 tokens, width 128, 4 blocks) runs its
            #   5.33 GFLOP (this model's count) in 213 ms, 200 ms once its fixed costs are off:
            #   26.6 GFLOP/s. Its matmuls alone ran 30 GFLOP/s (profiler; calibrate's peak:
            #   34.6), attention's kernel, GELU and LayerNorm took the rest (a share that shrinks
            #   as the width grows)
            # - 1.7e-3: a capstone block's forward and backward on 4 tokens (nearly no work),
            #   from depth 2 to 8: 1.7-1.9 ms per block; a micro-batch more cost the full step
            #   ~9 ms, 1.5 ms per layer
            # - 15e9: calibrate's copy bandwidth, 15.5 GB/s (read + write), host copies alike
            # - 12e9: the host's fused AdamW, 427 M parameters/s x 28 B (from_profile's count)
            # - 0.65e9 and 0.75 ms: the disk under the NVMe tier, a virtual disk: a 4 MiB
            #   memmap's msync took 6.45 ms (0.65 GB/s); the capstone's tier step ran 150 ms
            #   over optimizer offload's, with 162 files (3 per tensor) and 20 MB read and
            #   written: 31 ms of bytes at that rate, the rest 0.73 ms per file's flush
            # - 2.9e9: the capstone's plain step with activation offload ran 24.1 ms over the
            #   plain one (233.2 against 209.1 ms, benchmarks/README.md, bench_plan) for 2 x
            #   35.3 MB of saved tensors moved; priced at the copy bandwidth they were 4.7 ms
            #   (chapter 09 re-measures this term beyond the common factor with a bootstrap
            #   interval: +16.2 ms (12.7-22.8) where 7.2 ms were predicted, 2.2x, 4.4 GB/s, on a
            #   loaded 2-core CPU, Dec 2026; a run whose interval holds the prediction says so)
            return cls(26e9, 1.0, 1.7e-3, 15e9, 15e9, 1e9, 12e9, 0.65e9, 0.75e-3, 2.9e9)
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")

    @classmethod
    def from_profile(cls, profile, *, layer_seconds: float | None = None) -> "CostModel":
        """The speeds `companion.cost.calibrate` measured: peak fp32 matmul FLOP/s (on a CPU,
        the FLOP/s a GPT block's fp32 training step reaches, `DeviceProfile.step_flops`, as
        `for_device("cpu")`'s 26 GFLOP/s was measured), bf16 over fp32 where bf16 was timed (on
        a CPU, that block's autocast step over its fp32 one, `DeviceProfile.autocast`: the
        matmul peaks overstate it there; a LoRA adapter's passes, `adapter_bandwidth`; the 8-bit
        Adam step, `adam8bit`),
        copy bandwidth, host copies (pinned), gloo's bandwidth (1/β)
        and the host AdamW rate (28 bytes a parameter); `layer_seconds` defaults to 16x the
        measured tiny layer (a Linear(8, 8) and a ReLU): on the reference CPU a capstone block's
        forward and backward on 4 tokens cost 1.7 ms, 16x calibrate's 0.106 ms tiny layer.
        On a CPU, activation offload at the rate its hooks' copies reached in a block's step
        (`DeviceProfile.activation_offload`; a profile without it keeps `for_device("cpu")`'s);
        on a GPU at the host link's. The disk's rate is not calibrated."""
        fp32 = profile.peak_flops("float32")
        half = profile.peak_flops("bfloat16") / fp32 if "bfloat16" in profile.matmul else 1.0
        if profile.step_flops is not None:             # a CPU: the rate a block's step reaches
            fp32 = profile.step_flops.median
        if profile.autocast and "bfloat16" in profile.autocast:   # a CPU: the step's own rate
            half = profile.autocast["bfloat16"].median
        host = (profile.host_to_device or {}).get("pinned")
        rate = max(m.median for m in profile.adamw.values())
        return cls(fp32, half, 16 * profile.layer_seconds.median if layer_seconds is None
                   else layer_seconds, profile.copy_bandwidth.median,
                   host.median if host else profile.copy_bandwidth.median,
                   1 / profile.beta.median if profile.beta else 1e9, 28 * rate,
                   *_disk(profile.device),
                   (profile.activation_offload.median if profile.activation_offload else
                    CostModel.for_device("cpu").activation_bandwidth)
                   if profile.device.startswith("cpu") else None,
                   adapter_bandwidth=profile.adapter_bandwidth.median
                   if profile.adapter_bandwidth else None,
                   adapter_seconds=profile.adapter_seconds.median
                   if profile.adapter_seconds else 0.0,
                   adam8bit_rate=profile.adam8bit.median if profile.adam8bit else None,
                   adam8bit_tensor_seconds=profile.adam8bit_tensor.median
                   if profile.adam8bit_tensor else 0.0,
                   overlap=0.0 if profile.device.startswith("cpu") else 1.0)


def _disk(device: str) -> tuple[float, float]:
    """The NVMe tier's bandwidth and flush time a profile of `device` gets (not measured)."""
    model = CostModel.for_device("cpu") if device.startswith("cpu") else CostModel(1, 1, 0, 1, 1, 1)
    return model.disk_bandwidth, model.disk_sync_seconds
