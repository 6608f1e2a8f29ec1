"""GPUs on paper: memory, dense FLOP/s by dtype, bandwidths and on-chip SRAM, every number cited.

`calibrate()` (companion.cost.profile) measures the learner's device; this table holds the GPUs the
course talks about, from NVIDIA's datasheets, architecture whitepapers and the CUDA guide, so a
chapter can say what a step would cost on an H100 without one. Reading those documents:

- Tensor-core figures are often printed "with sparsity" (2:4 structured sparsity, the asterisk);
  dense training gets half. Every figure here is dense: sparse ones are halved.
- "fp32" is the CUDA cores. PyTorch runs float32 matmuls there unless TF32 is allowed
  (`torch.backends.cuda.matmul.allow_tf32`, off by default since 1.12); "tf32" is that path.
- GeForce cards (RTX 4090) run fp16/bf16/fp8 with fp32 accumulation at half the rate of fp16
  accumulation; training accumulates in fp32, so that figure is kept.
- Units: TB/s = 1e12 B/s, TFLOP/s = 1e12 FLOP/s. Capacity "GB" is binary on these boards (an
  "80 GB" H100 holds 80 GiB); CUDA gives a process 1-9% less, kept back by ECC and the driver.
- `usable_bytes` is what CUDA reports as the card's total (`torch.cuda.mem_get_info()[1]`,
  `get_device_properties().total_memory`, the "total capacity of X GiB" of PyTorch's
  out-of-memory message): the most a process can have, CUDA context included. Each is the lowest
  report found for that card (`usable_source` quotes it); a report in GiB with two decimals is
  taken at the bottom of its rounding (23.64 GiB: 23.635 GiB). A plan is fitted to it, never to
  `memory_bytes`.
- PCIe figures in datasheets add both directions: `pcie_bandwidth` is one direction, half.
  `nvlink_bandwidth` is the total NVIDIA quotes (both directions, all links of one GPU).
- `sram_per_sm` is an SM's combined L1 + shared memory; `shared_memory_per_sm` the most of it a
  program can take as shared memory, what FlashAttention's tiles must fit (attention.tiles).
- `nvlink_gpus` is how many GPUs one NVLink domain joins (8 on the SXM boards' NVSwitch or
  hybrid cube-mesh, 2 where a bridge joins a pair), `server_network` the compute network of
  NVIDIA's 8-GPU server built on the card (DGX), one direction, all its network cards together
  (`ring_link` uses both).
- None: the documents give no such figure (no bf16 on Volta or Turing, no NVLink on a PCIe card,
  SM counts NVIDIA does not print). Nothing is filled in by guess.

Peak is never reached. `efficiency(gpu, dtype)` gives the fraction that training reaches, with its
source: model FLOPs utilization (MFU: model FLOPs per second over peak, as defined by Chowdhery et
al. 2022, "PaLM", appendix B) reported in papers, until a recorded run of this course replaces it
(`measured_flops=`, `run=`). Tuned stacks go higher: FlashAttention-2 reaches 72% MFU training GPT
models on A100s (Dao 2023, arXiv:2307.08691); eager PyTorch on one GPU usually stays lower.

Example:
    >>> h100 = gpu("NVIDIA H100 80GB HBM3")                 # torch.cuda.get_device_name's string
    >>> h100.flops("bf16") / 1e12, h100.hbm_bandwidth / 1e12
    (989.5, 3.35)
    >>> round(ridge_point(h100, "bf16"))                     # FLOPs per byte to be compute-bound
    295
    >>> efficiency(h100, "bf16")[0]
    0.43
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["GPU", "GPUS", "GROUPS", "SERVER_GPUS", "gpu", "gpu_for_device", "ring_link",
           "ridge_point", "efficiency", "step_efficiency"]

KIB, GIB = 2**10, 2**30
GROUPS = ("memory", "flops", "bandwidth", "pcie", "nvlink", "sms", "sram")   # cited groups
_KEYS = ("fp32", "tf32", "bf16", "fp16", "fp8")
_NAMES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16",
          "half": "fp16"}


@dataclasses.dataclass(frozen=True)
class GPU:
    """One GPU's datasheet: bytes, dense FLOP/s by dtype and bytes/s, None where unpublished."""

    name: str
    memory_bytes: int                 # device memory
    fp32_flops: float                 # CUDA cores
    tf32_flops: float | None          # tensor cores, dense, from here on
    bf16_flops: float | None
    fp16_flops: float | None          # fp32 accumulation
    fp8_flops: float | None
    hbm_bandwidth: float              # B/s of device memory (HBM or GDDR)
    pcie_bandwidth: float             # B/s to the host, one direction
    pcie_gen: int
    nvlink_bandwidth: float | None    # B/s, both directions together
    sms: int | None                   # streaming multiprocessors
    sram_per_sm: int                  # bytes of L1 + shared memory per SM
    shared_memory_per_sm: int         # bytes of it one SM can give programs as shared memory
    compute_capability: str
    sources: tuple[str, ...]          # "group, group: document, URL" for each of GROUPS
    notes: str = ""
    usable_bytes: int = 0             # the total CUDA reports (set from _USABLE below)
    usable_source: str = ""           # the report it comes from
    nvlink_gpus: int | None = None    # GPUs one NVLink domain joins (set from _SERVERS below)
    server_network: float | None = None   # B/s, one direction, the DGX server's network cards
    server_source: str = ""           # where both come from

    def flops(self, dtype: torch.dtype | str) -> float:
        """Dense peak FLOP/s in `dtype`: a torch dtype, or "fp32", "tf32", "bf16", "fp16", "fp8"."""
        key = _dtype_key(dtype)
        value = getattr(self, f"{key}_flops")
        if value is None:
            have = ", ".join(k for k in _KEYS if getattr(self, f"{k}_flops") is not None)
            raise ValueError(f"the {self.name} has no {key} math (its datasheet lists none); "
                             f"it has {have}. {self.notes}".rstrip())
        return value

    def source(self, group: str) -> str:
        """The citation for one group of numbers (one of GROUPS)."""
        for line in self.sources:
            if group in line.partition(": ")[0].split(", "):
                return line
        raise ValueError(f"no source for {group!r} on the {self.name}; groups: {GROUPS}")


def _dtype_key(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.lower()
    else:
        raise TypeError(f"dtype must be a torch dtype or a string, got {dtype!r}")
    key = "fp8" if name.startswith("float8") else _NAMES.get(name, name)
    if key not in _KEYS:
        raise ValueError(f"unknown dtype {dtype!r}: use a torch dtype or one of {_KEYS}")
    return key


_V100_DS = ("NVIDIA V100 Tensor Core GPU datasheet (V100 SXM2 column), https://images.nvidia.com/"
            "content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf")
_VOLTA_WP = ("NVIDIA Tesla V100 GPU Architecture whitepaper, https://images.nvidia.com/content/"
             "volta-architecture/pdf/volta-architecture-whitepaper.pdf")
_T4_DS = ("NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
          "Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf")
_TURING_WP = ("NVIDIA Turing GPU Architecture whitepaper (64 FP32 cores per SM), https://images."
              "nvidia.com/aem-dam/en-zz/Solutions/design-visualization/technologies/turing-"
              "architecture/NVIDIA-Turing-Architecture-Whitepaper.pdf")
_A10_DS = ("NVIDIA A10 Tensor Core GPU datasheet (* = with sparsity), https://www.nvidia.com/"
           "content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf")
_GA102_WP = ("NVIDIA Ampere GA102 GPU Architecture whitepaper (one RT core per SM), "
             "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-"
             "whitepaper-v2.pdf")
_L4_DS = ("NVIDIA L4 Tensor Core GPU datasheet (* = with sparsity), https://resources.nvidia.com/"
          "en-us-data-center-overview/l4-gpu-datasheet")
_L40S_DS = ("NVIDIA L40S datasheet (dense and * sparse columns), https://resources.nvidia.com/"
            "en-us-l40s/l40s-datasheet-28413")
_ADA_WP = ("NVIDIA Ada GPU Architecture whitepaper, table 1 (RTX 4090; one RT core per SM), "
           "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/"
           "nvidia-ada-gpu-architecture.pdf")
_A100_DS = ("NVIDIA A100 Tensor Core GPU datasheet (A100 SXM columns, * = with sparsity), "
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_A100_WP = ("NVIDIA A100 Tensor Core GPU Architecture whitepaper, https://images.nvidia.com/"
            "aem-dam/en-zz/Solutions/data-center/nvidia-ampere-architecture-whitepaper.pdf")
_H100_DS = ("NVIDIA H100 Tensor Core GPU datasheet (* = with sparsity), "
            "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H100_WP = ("NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 3, "
            "https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper")
_H200_DS = ("NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column, * = with sparsity), https://"
            "nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446")
_HGX = ("NVIDIA HGX platform page, HGX B200 column (per-GPU figures, tensor ones with sparsity), "
        "https://www.nvidia.com/en-us/data-center/hgx/")
_GUIDE = ("CUDA C++ Programming Guide, 'Compute Capabilities' (L1 + shared size; maximum shared "
          "memory per SM), https://docs.nvidia.com/cuda/cuda-c-programming-guide/")


def _sram(cc: str) -> str:
    return f"sram: {_GUIDE}, compute capability {cc}"


GPUS: dict[str, GPU] = {
    "V100": GPU("V100", 32 * GIB, 15.7e12, None, None, 125e12, None, 900e9, 16e9, 3, 300e9, 80,
                128 * KIB, 96 * KIB, "7.0",
                (f"memory, flops, bandwidth, pcie, nvlink: {_V100_DS}", f"sms: {_VOLTA_WP}",
                 _sram("7.0")),
                "SXM2 32 GB (the 16 GB board computes the same). Volta's tensor cores do fp16 "
                "only: no tf32, bf16 or fp8."),
    "T4": GPU("T4", 16 * GIB, 8.1e12, None, None, 65e12, None, 320e9, 16e9, 3, None, 40,
              96 * KIB, 64 * KIB, "7.5",
              (f"memory, flops, bandwidth, pcie, nvlink: {_T4_DS}",
               f"sms: 2,560 CUDA cores ({_T4_DS}) / 64 per SM ({_TURING_WP})", _sram("7.5")),
              "Turing's tensor cores do fp16 only: no tf32, bf16 or fp8. Bandwidth: NVIDIA's T4 "
              "pages say 320+ GB/s, an early datasheet 300 GB/s."),
    "A10": GPU("A10", 24 * GIB, 31.2e12, 62.5e12, 125e12, 125e12, None, 600e9, 32e9, 4, None, 72,
               128 * KIB, 100 * KIB, "8.6",
               (f"memory, flops, bandwidth, pcie, nvlink: {_A10_DS}",
                f"sms: 72 RT cores ({_A10_DS}), {_GA102_WP}", _sram("8.6")),
               "Ampere has no fp8."),
    "L4": GPU("L4", 24 * GIB, 30.3e12, 60e12, 121e12, 121e12, 242.5e12, 300e9, 32e9, 4, None, None,
              128 * KIB, 100 * KIB, "8.9",
              (f"memory, flops, bandwidth, pcie, nvlink: {_L4_DS}",
               f"sms: not published ({_L4_DS} gives no core count)", _sram("8.9"))),
    "L40S": GPU("L40S", 48 * GIB, 91.6e12, 183e12, 362.05e12, 362.05e12, 733e12, 864e9, 32e9, 4,
                None, 142, 128 * KIB, 100 * KIB, "8.9",
                (f"memory, flops, bandwidth, pcie, nvlink: {_L40S_DS}",
                 f"sms: 142 RT cores ({_L40S_DS}), {_ADA_WP}", _sram("8.9"))),
    "RTX 4090": GPU("RTX 4090", 24 * GIB, 82.6e12, 82.6e12, 165.2e12, 165.2e12, 330.3e12, 1008e9,
                    32e9, 4, None, 128, 128 * KIB, 100 * KIB, "8.9",
                    (f"memory, flops, bandwidth, sms: {_ADA_WP}",
                     f"pcie, nvlink: {_ADA_WP} (PCIe 4.0 x16, 16 GT/s x 16 lanes: ~32 GB/s each "
                     "way by the PCI-SIG spec; no NVLink)", _sram("8.9")),
                    "Tensor figures with fp32 accumulation (fp16 accumulation doubles them)."),
    "A100 40GB": GPU("A100 40GB", 40 * GIB, 19.5e12, 156e12, 312e12, 312e12, None, 1555e9, 32e9, 4,
                     600e9, 108, 192 * KIB, 164 * KIB, "8.0",
                     (f"memory, flops, bandwidth, pcie, nvlink: {_A100_DS}", f"sms: {_A100_WP}",
                      _sram("8.0")), "SXM4. Ampere has no fp8."),
    "A100 80GB": GPU("A100 80GB", 80 * GIB, 19.5e12, 156e12, 312e12, 312e12, None, 2039e9, 32e9, 4,
                     600e9, 108, 192 * KIB, 164 * KIB, "8.0",
                     (f"memory, flops, bandwidth, pcie, nvlink: {_A100_DS}", f"sms: {_A100_WP}",
                      _sram("8.0")), "SXM4. Ampere has no fp8."),
    "H100 PCIe": GPU("H100 PCIe", 80 * GIB, 51e12, 378e12, 756.5e12, 756.5e12, 1513e12, 2000e9,
                     64e9, 5, 600e9, 114, 256 * KIB, 228 * KIB, "9.0",
                     (f"memory, flops, bandwidth, pcie, nvlink: {_H100_DS}", f"sms: {_H100_WP}",
                      _sram("9.0")), "HBM2e; NVLink through a bridge to one other card."),
    "H100 SXM": GPU("H100 SXM", 80 * GIB, 67e12, 494.5e12, 989.5e12, 989.5e12, 1979e12, 3350e9,
                    64e9, 5, 900e9, 132, 256 * KIB, 228 * KIB, "9.0",
                    (f"memory, flops, bandwidth, pcie, nvlink: {_H100_DS}", f"sms: {_H100_WP}",
                     _sram("9.0")), "SXM5, HBM3."),
    "H200": GPU("H200", 141 * GIB, 67e12, 494.5e12, 989.5e12, 989.5e12, 1979e12, 4800e9, 64e9, 5,
                900e9, None, 256 * KIB, 228 * KIB, "9.0",
                (f"memory, flops, bandwidth, pcie, nvlink: {_H200_DS}",
                 f"sms: not published ({_H200_DS} gives none)", _sram("9.0")),
                "SXM, HBM3e; the H100 SXM's compute figures with more, faster memory."),
    "B200": GPU("B200", 180 * GIB, 75e12, 1.1e15, 2.25e15, 2.25e15, 4.5e15, 7.7e12, 64e9, 5, 1.8e12,
                None, 256 * KIB, 228 * KIB, "10.0",
                (f"memory, flops, bandwidth, pcie, nvlink: {_HGX}",
                 f"sms: not published ({_HGX} gives none)", _sram("10.0")),
                "HGX B200 (1,000 W). NVIDIA's figures moved between announcements (192 GB and "
                "8 TB/s at first; the DGX B200 datasheet: 1,440 GB and 64 TB/s for 8 GPUs)."),
}

MIB = 2**20
_FIND = "public GitHub code, found with find_string"
# The card's total as CUDA reports it, the lowest report found (MiB), and where it was read.
_USABLE = {
    "V100": (32_512, '"31.75 GiB total capacity" in PyTorch out-of-memory messages (e.g. "GPU 0; '
                     '31.75 GiB total capacity; 30.30 GiB already allocated"), the 32 GB V100\'s '
                     f'total; {_FIND}'),
    "T4": (14_914, '"GPU 0 has a total capacity of 14.57 GiB" on a T4 (a benchmark\'s failed-case '
                   'log, T4 beside A10 and B200), taken at 14.565 GiB; torch\'s total_memory on '
                   f'Colab T4s: 14,930-15,109 MiB; {_FIND}'),
    "A10": (22_584, '"GPU 0 has a total capacity of 22.06 GiB" on an A10 (the same log), taken at '
                    '22.055 GiB; AWS\'s A10G reports total_memory=22587MB; '
                    f'{_FIND}'),
    "L4": (22_677, 'derived, no PyTorch report found that names the L4: nvidia-smi\'s memory.total '
                   '"NVIDIA L4, 23034 MiB" (many reports), less 357 MiB, what the RTX 4090 loses '
                   'from its nvidia-smi total (24,564 MiB) to its lowest PyTorch report (23.635 '
                   f'GiB); {_FIND}'),
    "L40S": (45_414, 'torch "total_memory=45589MB" (_CudaDeviceProperties, NVIDIA L40S) and "L40S | '
                     '44.4 GiB" in a run table of total capacities, taken at 44.35 GiB; '
                     f'{_FIND}'),
    "RTX 4090": (24_202, '"GPU 0 has a total capacity of 23.64 GiB" on 24 GB 4090s (a ZeRO-2 run '
                         'on "24GB 4090"; an RTX 4090 D), taken at 23.635 GiB; torch\'s '
                         'total_memory=24563MB on another 4090, and 23.70 GiB on an RTX 3090 '
                         f'(huggingface/transformers#8771); {_FIND}'),
    "A100 40GB": (40_330, '"Used 38.61/39.39 GiB on A100-40GB" and "total capacity of 39.39 GiB" '
                          'in out-of-memory messages, taken at 39.385 GiB; paddle\'s '
                          f'total_memory=40536MB for an A100-SXM4-40GB; {_FIND}'),
    "A100 80GB": (81_044, '"GPU 0 has a total capacity of 79.15 GiB" on an 80 GB A100 (an RLHF '
                          'tutorial\'s out-of-memory error), taken at 79.145 GiB; an '
                          f'A100-SXM4-80GB\'s totalGlobalMem: 81,221.8 MiB; {_FIND}'),
    "H100 PCIe": (81_008, 'torch "total_memory=81008MB" (_CudaDeviceProperties, NVIDIA H100 PCIe); '
                          f'{_FIND}'),
    "H100 SXM": (81_082, 'torch 2.0.1 "total_memory=81082MB" (_CudaDeviceProperties, NVIDIA H100 '
                         '80GB HBM3), the lowest of 81,082-81,106 MiB (thamada/nvidia-smi, '
                         'nvsim/H100SXMx8_deviceQuery.py: 85,045,477,376 bytes); out-of-memory '
                         f'messages say 79.18-79.25 GiB; {_FIND}'),
    "H200": (143_156, 'torch "total_memory=143156MB" (_CudaDeviceProperties, NVIDIA H200); '
                      f'{_FIND}'),
    "B200": (182_631, 'torch "total_memory=182631MB" and "182642MB" (_CudaDeviceProperties, '
                      f'NVIDIA B200); {_FIND}'),
}
SERVER_GPUS = 8                 # GPUs in one server (an HGX board, a DGX, a PCIe server)
_BASEPOD = ("NVIDIA DGX BasePOD reference architecture, 'Core Components' (DGX B200, H200 and H100: "
            "eight single-port ConnectX-7, up to 400 Gb/s InfiniBand/Ethernet, for the compute "
            "fabric), https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-"
            "foundation-enterprise-ai/latest/core-components.html")
_DGX_A100 = ("NVIDIA, 'Defining AI Innovation with NVIDIA DGX A100' (eight single-port ConnectX-6 "
             "200 Gb/s HDR InfiniBand), https://developer.nvidia.com/blog/defining-ai-innovation-"
             "with-dgx-a100")
_DGX1 = ("NVIDIA DGX-1 with Tesla V100 System Architecture whitepaper (hybrid cube-mesh NVLink "
         "among 8 V100s; four 100 Gb/s InfiniBand cards), https://images.nvidia.com/content/pdf/"
         "dgx1-v100-system-architecture-whitepaper.pdf")
_GBIT = 1e9 / 8                 # B/s in one Gb/s
# (GPUs one NVLink domain joins, the 8-GPU DGX's compute network in B/s one way, the sources)
_SERVERS = {
    "V100": (8, 4 * 100 * _GBIT, _DGX1),
    "A100 40GB": (8, 8 * 200 * _GBIT, _DGX_A100),
    "A100 80GB": (8, 8 * 200 * _GBIT, _DGX_A100),
    "H100 PCIe": (2, None, f"NVLink bridge to one other card: {_H100_DS}; no DGX"),
    "H100 SXM": (8, 8 * 400 * _GBIT, _BASEPOD),
    "H200": (8, 8 * 400 * _GBIT, _BASEPOD),
    "B200": (8, 8 * 400 * _GBIT, _BASEPOD),
}
GPUS = {name: dataclasses.replace(g, usable_bytes=_USABLE[name][0] * MIB,
                                  usable_source=_USABLE[name][1],
                                  **(dict(zip(("nvlink_gpus", "server_network", "server_source"),
                                              _SERVERS[name])) if name in _SERVERS else {}))
        for name, g in GPUS.items()}

# names torch.cuda.get_device_name reports, beyond the table's own keys (both normalized)
_DEVICE_NAMES = {"v100sxm232gb": "V100", "a100sxm440gb": "A100 40GB", "a100sxm480gb": "A100 80GB",
                 "h10080gbhbm3": "H100 SXM", "h100sxm580gb": "H100 SXM", "h100sxm": "H100 SXM"}
_AMBIGUOUS = {"a100": ("A100 40GB", "A100 80GB"), "h100": ("H100 PCIe", "H100 SXM")}


def _norm(name: str) -> str:
    name = name.lower()
    for word in ("nvidia", "tesla", "geforce"):
        name = name.replace(word, "")
    return "".join(c for c in name if c.isalnum())


def _candidates(name: str) -> tuple[str, ...]:
    key = _norm(name)
    own = {_norm(k): k for k in GPUS}
    if key in own:
        return (own[key],)
    if key in _DEVICE_NAMES:
        return (_DEVICE_NAMES[key],)
    return _AMBIGUOUS.get(key, ())


def gpu(name: str) -> GPU:
    """The table's entry for `name`: a key ("H100 SXM") in any case and spacing, or the name
    torch.cuda.get_device_name reports ("NVIDIA H100 80GB HBM3", "Tesla T4")."""
    if not isinstance(name, str):
        raise TypeError(f"gpu() takes a name, got {name!r}; for a device use gpu_for_device")
    found = _candidates(name)
    if len(found) == 1:
        return GPUS[found[0]]
    if found:
        raise ValueError(f"{name!r} could be the {' or the '.join(found)}: say which "
                         "(they differ in memory and bandwidth)")
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)} (torch's device names, "
                     "such as 'NVIDIA H100 80GB HBM3', work too)")


def gpu_for_device(device: torch.device | str | int) -> GPU | None:
    """The entry for a CUDA device, found by its name (and its memory where the name leaves the
    variant open); None on a CPU or for a GPU the table lacks."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    found = _candidates(torch.cuda.get_device_name(device))
    if not found:
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return GPUS[min(found, key=lambda k: abs(GPUS[k].memory_bytes - total))]


def _as_gpu(value: GPU | str) -> GPU:
    return value if isinstance(value, GPU) else gpu(value)


def ring_link(gpu: GPU | str, world_size: int = SERVER_GPUS, *,
              network: float | None = None) -> tuple[str, float]:
    """(what bounds it, bytes/s one way) of a ring collective over `world_size` of these GPUs.

    Inside one NVLink domain (`nvlink_gpus`): one direction of NVLink. Inside one server of
    `SERVER_GPUS` otherwise: PCIe (a bridge joins only its pair, so 8 H100 PCIe ring over PCIe).
    Across servers the ring leaves each server once per channel, and NCCL spreads its channels
    over the server's network cards, so the ring runs at the slower of the link inside a server
    and all its cards together: NCCL's bus bandwidth across nodes reaches about that (two A100
    servers with 8 x 100 Gb/s cards: ~600 Gb/s, NVIDIA/nccl#495; two HGX A100 with 4 x 200 Gb/s:
    91 GB/s, NVIDIA/nccl-tests#100; 248 servers of 8 H200 with 8 x 400 Gb/s: ~350 GB/s,
    NVIDIA/nccl-tests#283). `network` (B/s one way, all of a server's cards) defaults to the
    card's DGX (`server_network`); for a card without one it is assumed to keep up with PCIe
    (cards moving one GPU's PCIe bandwidth: 256 Gb/s for PCIe 4.0, 512 Gb/s for 5.0): pass
    yours where it is less (one 100 Gb/s card: 12.5e9). Every figure is a peak per direction:
    an upper bound on the bus bandwidth NCCL reaches, most of all in a PCIe server whose ring
    crosses its CPU sockets."""
    g = _as_gpu(gpu)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if network is not None and not network > 0:
        raise ValueError(f"network must be positive bytes/s, got {network!r}")
    nvlink = g.nvlink_bandwidth / 2 if g.nvlink_bandwidth else None
    if nvlink and world_size <= (g.nvlink_gpus or 0):
        return "NVLink", nvlink
    inside = ("NVLink", nvlink) if nvlink and (g.nvlink_gpus or 0) >= SERVER_GPUS else \
        ("PCIe", g.pcie_bandwidth)
    if world_size <= SERVER_GPUS:
        return inside
    network = network if network is not None else g.server_network
    if network is None or network >= inside[1]:
        return inside
    return "network", network


def ridge_point(gpu: GPU | str, dtype: torch.dtype | str) -> float:
    """FLOPs per byte of device memory where the roofline turns compute-bound: peak / bandwidth
    (Williams, Waterman & Patterson 2009, "Roofline", CACM 52(4))."""
    g = _as_gpu(gpu)
    return g.flops(dtype) / g.hbm_bandwidth


# Tensor-core MFU reported for training, by the GPU family it was measured on
_TENSOR = {
    "V100": (0.30, "Shoeybi et al. 2019, 'Megatron-LM: Training Multi-Billion Parameter Language "
                   "Models Using Model Parallelism' (arXiv:1909.08053): 39 TFLOP/s, 30% of peak, "
                   "a 1.2B-parameter GPT-2 on one V100", ("V100",)),
    "A100": (0.52, "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
                   "Clusters Using Megatron-LM' (arXiv:2104.04473): 163 TFLOP/s per GPU, 52% of "
                   "peak, a 1T-parameter GPT on 3,072 A100s (recomputation counted)",
             ("A100 40GB", "A100 80GB")),
    "H100": (0.43, "Llama Team 2024, 'The Llama 3 Herd of Models' (arXiv:2407.21783), table 4: "
                   "43% bf16 MFU, 430 TFLOP/s per GPU on 8,192 H100s", ("H100 SXM",)),
}
_TENSOR_FROM = {"V100": "V100", "T4": "V100", "A10": "A100", "L4": "A100", "L40S": "A100",
                "RTX 4090": "A100", "A100 40GB": "A100", "A100 80GB": "A100",
                "H100 PCIe": "H100", "H100 SXM": "H100", "H200": "H100", "B200": "H100"}
_FP32 = (0.60, "cited: Boehm 2022, 'How to Optimize a CUDA Matmul Kernel for cuBLAS-like "
               "Performance: a Worklog' (https://siboehm.com/articles/22/CUDA-MMM): cuBLAS SGEMM "
               "at 23.2 TFLOP/s on an RTX A6000 (4096 x 4096), 60% of its 38.7 TFLOP/s datasheet "
               "peak; one large matmul, so an upper bound for a training step")


def efficiency(gpu: GPU | str, dtype: torch.dtype | str, *, measured_flops: float | None = None,
               run: str | None = None) -> tuple[float, str]:
    """(fraction of `dtype`'s peak that training reaches, where the number came from).

    Cited by default: "cited: ..." names the paper; a GPU with no published figure borrows its
    family's and says so. A recorded run overrides it: pass the FLOP/s it measured (e.g. its
    `DeviceProfile.peak_flops(dtype)`) and the file it is in, and get
    (measured / peak, "recorded: <run>"). fp8 and tf32 reuse the bf16/fp16 training figures.
    """
    g = _as_gpu(gpu)
    peak = g.flops(dtype)                                   # raises for math the GPU lacks
    if measured_flops is not None:
        if not run:
            raise ValueError("name the run that measured it: run='course/results/<machine>.json'")
        if not 0 < measured_flops <= peak:
            raise ValueError(f"measured {measured_flops:.3g} FLOP/s against a {g.name} "
                             f"{_dtype_key(dtype)} peak of {peak:.3g}: it must lie in (0, peak]; "
                             "was it timed in another dtype (TF32 counted as fp32?) or on "
                             "another GPU?")
        return measured_flops / peak, f"recorded: {run}"
    if _dtype_key(dtype) == "fp32":
        return _FP32
    if g.name not in _TENSOR_FROM:
        raise ValueError(f"no cited efficiency for {g.name!r}: pass measured_flops= and run=")
    factor, citation, measured_on = _TENSOR[_TENSOR_FROM[g.name]]
    if g.name in measured_on:
        return factor, f"cited: {citation}"
    return factor, (f"cited for the {_TENSOR_FROM[g.name]}, no published figure for the {g.name}: "
                    f"{citation}")


# A whole training step's MFU by setup (what the planner's `CostModel.for_gpu` prices bf16 at):
# (family, compiled) -> (factor, which setup, source). The planner plans eager PyTorch (the
# course's code, FSDP for ZeRO-3): eager is the default.
_TORCHTITAN = ("torchtitan docs/performance.md (pytorch/torchtitan at bf835b5, 2025-06-13), "
               "Table 1: Llama 3.1 8B, 8 H100 (96 GB HBM2e, 500 W), local batch 2 x 8192, "
               "selective activation checkpointing: FSDP {} tok/s/GPU; 'the 1D Llama 3.1 8B model "
               "training on 8 or 128 H100 GPUs without Float8 achieves 33% to 39% MFU'. Here "
               "{} x 63.01 GFLOP a token (6 x 7.505e9 matmul weights + 12·L·C·T attention, "
               "torchtitan's count and the planner's, 57.91, + 5.10 its op-level selective "
               "policy redoes: the k, o and up products again, 2·L·(C·kv + C² + C·I)) / 989.5 "
               "TFLOP/s = {:.3f} of the FLOPs the GPU ran; its 500 W parts run below that peak "
               "(footnote 2), so an H100 SXM at 700 W runs faster")
_SETUPS = {
    ("H100", False): (0.367, "eager FSDP, H100", _TORCHTITAN.format("5,762", "5,762", 0.367)),
    ("H100", True): (0.425, "FSDP + torch.compile, H100",
                     _TORCHTITAN.format("+ torch.compile 6,667", "6,667", 0.425)),
    ("A100", False): (0.57, "eager FSDP, A100",
                      "PyTorch blog 'Maximizing training throughput using PyTorch FSDP' (IBM and "
                      "Meta, 2024-03-13, https://research.ibm.com/blog/pytorch-fsdp): Llama 2 "
                      "7B on 128 A100s, 3,700 tok/s/GPU, 'a model FLOPS utilization (MFU) ... "
                      "of 57%', MFU and HFU alike (no recompute at 7B; SDPA FlashAttention; "
                      "torch.compile came in the follow-up post)"),
    ("A100", True): (0.68, "FSDP + torch.compile, A100",
                     "PyTorch blog 'Maximizing training throughput using PyTorch FSDP and Torch."
                     "compile' (https://pytorch.org/blog/maximizing-training-throughput/): "
                     "'we achieve a MFU of 68% for the 7B model on A100 GPUs'"),
    ("GeForce", True): (0.548, "torch.compile, one GeForce RTX 4090",
                        "karpathy/nanoGPT issue #182 (comment of 2023-03-02): 'on 1x 4090 GPU, "
                        "I am getting 29% MFU while training GPT-2 124M model'; nanoGPT's MFU "
                        "is over the A100's 312 TFLOP/s (model.py estimate_mfu, compile=True "
                        "by default): 90.5 TFLOP/s, 0.548 of the 4090's 165.2 (fp32 "
                        "accumulation)"),
    ("GeForce", False): (0.474, "eager, one GeForce RTX 4090",
                         "no published eager figure: the compiled 4090's 0.548 x torchtitan's "
                         "eager over compiled (5,762 / 6,667)"),
    ("V100", False): (0.30, "eager Megatron-LM, one V100", _TENSOR["V100"][1]),
}
_SETUP_FAMILY = {"V100": "V100", "T4": "V100", "A10": "A100", "A100 40GB": "A100",
                 "A100 80GB": "A100", "L4": "GeForce", "L40S": "GeForce", "RTX 4090": "GeForce",
                 "H100 PCIe": "H100", "H100 SXM": "H100", "H200": "H100", "B200": "H100"}


def step_efficiency(gpu: GPU | str, *, compiled: bool = False) -> tuple[float, str]:
    """(MFU a whole training step reaches in bf16 on `gpu`, "setup: source"), by setup: eager
    PyTorch (the planner's default, as the course runs) or torch.compile'd, from the closest
    published run (`_SETUPS`); a GPU without a run of its own borrows its family's and says so.
    Unlike `efficiency` (tuned 3D/4D-parallel runs), these are single-node FSDP or one-GPU runs."""
    g = _as_gpu(gpu)
    family = _SETUP_FAMILY[g.name]
    factor, setup, source = _SETUPS.get((family, compiled), _SETUPS[(family, False)])
    if (family, compiled) not in _SETUPS:
        setup += " (no compiled figure: eager's)"
    where = "" if g.name in ("H100 SXM", "A100 40GB", "A100 80GB", "RTX 4090", "V100") \
        else f" (borrowed for the {g.name})"
    return factor, f"{setup}{where}: {source}"
