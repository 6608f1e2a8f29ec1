"""companion.cost.gpus: every number cited, dense figures where datasheets print sparse ones,
lookups by torch's device names, and errors that name what is missing."""
import pytest
import torch

from companion.attention.tiles import SRAM_PER_SM
from companion.cost import gpus
from companion.cost.gpus import (GPUS, GROUPS, efficiency, gpu, gpu_for_device, ridge_point,
                                 ring_link)
from companion.cost.speeds import Speeds


@pytest.mark.parametrize("name", list(GPUS))
def test_every_entry_cites_every_group_of_numbers(name):
    g = GPUS[name]
    assert g.name == name
    for group in GROUPS:
        citation = g.source(group)
        assert "http" in citation or "not published" in citation, (name, group, citation)
    if g.sms is None:
        assert "not published" in g.source("sms")


@pytest.mark.parametrize("name, dtype, dense", [
    ("A100 40GB", "bf16", 312e12),        # datasheet: 312 | 624*
    ("A100 80GB", "tf32", 156e12),        # 156 | 312*
    ("H100 SXM", "bf16", 989.5e12),       # 1,979*
    ("H100 SXM", "fp8", 1979e12),         # 3,958*
    ("H100 PCIe", "bf16", 756.5e12),      # 1,513*
    ("H200", torch.bfloat16, 989.5e12),   # 1,979*
    ("L4", torch.float16, 121e12),        # 242*
    ("L40S", "bf16", 362.05e12),          # printed dense
    ("V100", "fp16", 125e12),             # Volta has no sparsity
    ("T4", torch.float32, 8.1e12),
    ("B200", "bf16", 2.25e15),            # HGX B200: 4.5 PFLOPS*
])
def test_flops_are_the_dense_halves_of_the_datasheets(name, dtype, dense):
    assert GPUS[name].flops(dtype) == pytest.approx(dense)


@pytest.mark.parametrize("g", list(GPUS.values()), ids=list(GPUS))
def test_usable_bytes_are_what_cuda_reports_below_the_nominal_size_with_a_source(g):
    # CUDA keeps back 1-9% (ECC, the driver); a plan is fitted to usable_bytes, never nominal
    assert 0.9 * g.memory_bytes < g.usable_bytes < g.memory_bytes
    assert g.usable_bytes % 2**20 == 0 and g.usable_source
    assert "derived" in g.usable_source or "GiB" in g.usable_source or "MB" in g.usable_source


@pytest.mark.parametrize("name, reported_gib", [
    ("RTX 4090", 23.64), ("H100 SXM", 81082 / 1024), ("A100 40GB", 39.39), ("A100 80GB", 79.15),
    ("T4", 14.57), ("V100", 31.75), ("H200", 143156 / 1024), ("B200", 182631 / 1024),
])
def test_usable_bytes_match_the_reports_they_cite(name, reported_gib):
    # the lowest report, taken at the bottom of its two-decimal rounding: never above it
    usable = GPUS[name].usable_bytes / 2**30
    assert reported_gib - 0.006 < usable <= reported_gib + 1e-9


def test_units_are_bytes_and_bytes_per_second():
    assert GPUS["H100 SXM"].hbm_bandwidth == 3.35e12 and GPUS["A100 40GB"].hbm_bandwidth == 1.555e12
    assert GPUS["H100 SXM"].memory_bytes == 80 * 2**30
    assert GPUS["H100 SXM"].pcie_bandwidth == 64e9 and GPUS["H100 SXM"].pcie_gen == 5
    assert GPUS["A100 80GB"].nvlink_bandwidth == 600e9 and GPUS["T4"].nvlink_bandwidth is None
    assert GPUS["H100 SXM"].sram_per_sm == 256 * 1024
    assert GPUS["H100 SXM"].shared_memory_per_sm == 228 * 1024


@pytest.mark.parametrize("g", list(GPUS.values()), ids=list(GPUS))
def test_the_table_is_consistent(g):
    assert g.fp16_flops is not None and g.fp32_flops < g.fp16_flops
    if g.tf32_flops is not None:
        assert g.fp32_flops <= g.tf32_flops <= g.bf16_flops
    if g.bf16_flops is not None:
        assert g.bf16_flops == g.fp16_flops
    if g.fp8_flops is not None:                          # L40S: 733 against 2 x 362.05
        assert g.fp8_flops == pytest.approx(2 * g.bf16_flops, rel=0.02)
    assert g.pcie_bandwidth == {3: 16e9, 4: 32e9, 5: 64e9}[g.pcie_gen]
    assert g.shared_memory_per_sm < g.sram_per_sm
    assert 2**30 < g.memory_bytes < 2**40 and 1e11 < g.hbm_bandwidth < 1e13


def test_missing_math_raises_a_clear_error():
    with pytest.raises(ValueError, match="V100 has no bf16.*fp32, fp16"):
        GPUS["V100"].flops(torch.bfloat16)
    with pytest.raises(ValueError, match="A100 40GB has no fp8"):
        GPUS["A100 40GB"].flops(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="unknown dtype"):
        GPUS["H100 SXM"].flops("int8")
    with pytest.raises(ValueError, match="unknown dtype"):
        GPUS["H100 SXM"].flops(torch.float64)


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H200", "H200"), ("Tesla T4", "T4"), ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB"), ("Tesla V100-SXM2-32GB", "V100"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA L40S", "L40S"), ("NVIDIA B200", "B200"),
    ("h100 sxm", "H100 SXM"), ("rtx4090", "RTX 4090"), ("a100-80gb", "A100 80GB"),
])
def test_lookup_by_torch_device_names_and_loose_spellings(name, key):
    assert gpu(name) is GPUS[key]


def test_lookup_errors_say_what_to_do():
    with pytest.raises(ValueError, match="known: V100, T4.*B200"):
        gpu("NVIDIA GeForce RTX 3060")
    with pytest.raises(ValueError, match="A100 40GB or the A100 80GB"):
        gpu("A100")
    with pytest.raises(TypeError, match="gpu_for_device"):
        gpu(torch.device("cpu"))


def _fake_cuda(monkeypatch, name, total):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    props = type("Props", (), {"total_memory": total})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_gpu_for_device(monkeypatch):
    assert gpu_for_device("cpu") is None
    _fake_cuda(monkeypatch, "NVIDIA H200", 150_000_000_000)
    assert gpu_for_device("cuda") is GPUS["H200"] and gpu_for_device(0) is GPUS["H200"]
    _fake_cuda(monkeypatch, "NVIDIA A100", 85_000_000_000)         # the memory settles it
    assert gpu_for_device("cuda:0") is GPUS["A100 80GB"]
    _fake_cuda(monkeypatch, "NVIDIA GeForce RTX 3060", 12 * 2**30)
    assert gpu_for_device("cuda") is None


def test_ridge_point():
    assert ridge_point("A100 40GB", "bf16") == pytest.approx(312e12 / 1.555e12)
    assert ridge_point(GPUS["H100 SXM"], torch.float32) == pytest.approx(67e12 / 3.35e12)
    assert ridge_point("H100 SXM", "bf16") > ridge_point("H100 SXM", "fp32")


@pytest.mark.parametrize("name", list(GPUS))
def test_efficiency_is_cited_for_every_gpu(name):
    for dtype in ("fp32", "fp16"):
        factor, source = efficiency(name, dtype)
        assert 0 < factor < 1 and source.startswith("cited") and "20" in source
    assert ("no published figure" in efficiency(name, "fp16")[1]) == (
        name not in ("V100", "A100 40GB", "A100 80GB", "H100 SXM"))


def test_cited_factors_match_their_papers():
    factor, source = efficiency("A100 80GB", "bf16")
    assert factor == 0.52 and "Narayanan et al. 2021" in source
    assert efficiency("H100 SXM", torch.bfloat16)[0] == 0.43
    assert efficiency("V100", "fp16")[0] == 0.30


def test_a_recorded_run_overrides_the_citation():
    factor, source = efficiency("H200", "bf16", measured_flops=700e12,
                                run="course/results/nvidia-h200.json")
    assert factor == pytest.approx(700 / 989.5)
    assert source == "recorded: course/results/nvidia-h200.json"
    with pytest.raises(ValueError, match="run="):
        efficiency("H200", "bf16", measured_flops=700e12)
    with pytest.raises(ValueError, match="TF32 counted as fp32"):
        efficiency("H200", "fp32", measured_flops=400e12, run="r.json")
    with pytest.raises(ValueError, match="has no bf16"):
        efficiency("T4", "bf16")


def test_tiles_reads_its_sram_from_the_table():
    expected = {"V100": 96, "T4": 64, "A100": 164, "A10": 100, "RTX 4090": 100, "L4": 100,
                "H100": 228, "H200": 228, "B200": 228}
    assert {k: v["bytes"] // 1024 for k, v in SRAM_PER_SM.items()} == expected
    assert list(SRAM_PER_SM) == list(expected)                       # the order checks iterate in
    assert SRAM_PER_SM["B200"]["cc"] == "10.0"
    assert "compute capability 10.0" in SRAM_PER_SM["B200"]["source"]
    assert SRAM_PER_SM["H100"]["bytes"] == gpus.GPUS["H100 SXM"].shared_memory_per_sm


def test_ring_link_inside_a_domain_a_server_and_across_servers():
    """NVLink inside its domain; 8 H100 PCIe (a bridge joins pairs) ring over PCIe; across
    servers the DGX's network cards together bound the ring where they are slower."""
    assert ring_link("H100 SXM", 8) == ("NVLink", 450e9)
    assert ring_link("H100 PCIe", 2) == ("NVLink", 300e9)
    assert ring_link("H100 PCIe", 8) == ("PCIe", 64e9)
    assert ring_link("H100 SXM", 16) == ("network", 8 * 400e9 / 8)      # 8 x 400 Gb/s
    assert ring_link("A100 80GB", 64) == ("network", 200e9)             # 8 x 200 Gb/s
    assert ring_link("V100", 16) == ("network", 50e9)                   # 4 x 100 Gb/s
    assert ring_link("L40S", 64) == ("PCIe", 32e9)                      # assumed to keep up
    assert ring_link("L40S", 64, network=12.5e9) == ("network", 12.5e9)  # one 100 Gb/s card
    assert ring_link("B200", 16, network=1e15) == ("NVLink", 900e9)
    for name, g in GPUS.items():
        if g.nvlink_bandwidth:
            assert g.nvlink_gpus and g.server_source, name
        for world in (2, 8, 16, 64):
            assert Speeds.for_gpu(name, "fp16", world_size=world).beta == \
                1 / ring_link(name, world)[1]


@pytest.mark.parametrize("bad, match", [(dict(world_size=0), "world_size"),
                                        (dict(world_size=2.0), "world_size"),
                                        (dict(network=0), "network")])
def test_ring_link_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        ring_link("H100 SXM", **{"world_size": 16, **bad})
