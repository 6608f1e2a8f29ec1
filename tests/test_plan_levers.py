"""The planner's levers beyond the first chapters' (issue 33): the 18 B layout (fp32 main_grad),
chunked cross-entropy, activation offload, fused attention and the NVMe tier. Each lever's
predicted bytes against the simulated step, its losses against the plain run, its validation."""
import functools

import pytest

from companion.models import GPT
from companion.plan import Candidate, GPTShape, candidates, predict_memory, run_plan, simulate
from companion.plan.predict import predict_seconds
from companion.plan.costmodel import CostModel

FUSED = functools.partial(GPT, 2048, 64, 64, 4, 4, fused_attention=True)
WRITTEN = functools.partial(GPT, 2048, 64, 64, 4, 4)


@pytest.mark.parametrize("cand, tolerance", [
    (Candidate(8, precision="main_grad"), 0.0),
    (Candidate(2, 4, precision="main_grad"), 0.0),
    (Candidate(8, segments=2, precision="main_grad"), 0.0),
    (Candidate(8, chunked_loss=8), 0.01),
    (Candidate(8, precision="autocast", chunked_loss=8), 0.03),
    (Candidate(4, 2, segments=2, chunked_loss=8), 0.06),
    (Candidate(8, activation_offload=True), 0.0),
    (Candidate(8, precision="autocast", activation_offload=True), 0.0),
    (Candidate(4, 2, segments=2, activation_offload=True), 0.01),
    (Candidate(8, offload=True, activation_offload=True), 0.05),
])
def test_each_lever_predicts_the_simulated_peak(cand, tolerance):
    predicted = predict_memory(GPTShape.of(FUSED), cand).peak
    simulated = simulate(FUSED, cand).peak
    assert abs(predicted / simulated - 1) <= tolerance + 1e-4, (predicted, simulated)  # 1e-4: the
    # simulated step's few bytes of step counters


def test_fused_attention_as_a_lever_removes_the_t_by_t_term():
    shape = GPTShape.of(WRITTEN)
    fused = predict_memory(shape, Candidate(8, fused_attention=True)).peak
    simulated = simulate(WRITTEN, Candidate(8, fused_attention=True)).peak
    assert abs(fused / simulated - 1) < 1e-4 and simulated == simulate(FUSED, Candidate(8)).peak
    assert fused < predict_memory(shape, Candidate(8)).peak
    assert any(c.fused_attention for c in candidates(shape, 8, allow=("fused_attention",)))
    assert not any(c.fused_attention for c in candidates(GPTShape.of(FUSED), 8,
                                                         allow=("fused_attention",)))


def test_activation_offload_moves_the_saved_tensors_to_the_host():
    plain = simulate(FUSED, Candidate(8))
    moved = simulate(FUSED, Candidate(8, activation_offload=True))
    assert moved.peak < 0.7 * plain.peak and moved.host_peak > 0.5 * plain.breakdown()["activations"]
    host = predict_memory(GPTShape.of(FUSED), Candidate(8, activation_offload=True)).host
    assert abs(host / moved.host_peak - 1) < 0.05


def test_18_bytes_per_parameter_with_main_grad():
    shape = GPTShape.of(FUSED)
    p = predict_memory(shape, Candidate(8, precision="main_grad"))
    assert p.parameters == 2 * shape.n_params and p.gradients == 4 * shape.n_params
    assert p.optimizer_state == 12 * shape.n_params        # fp32 master + two moments


@pytest.mark.parametrize("cand", [Candidate(4, 2, chunked_loss=8),
                                  Candidate(8, activation_offload=True),
                                  Candidate(4, 2, offload=True, nvme=True)])
def test_exact_levers_train_like_the_plain_run(cand):
    fn = functools.partial(GPT, 128, 32, 32, 2, 2, fused_attention=True)
    plain = run_plan(fn, Candidate(8), 8, 3)
    other = run_plan(fn, cand, 8, 3)
    assert max(abs(a - b) for a, b in zip(plain.losses, other.losses)) < 1e-5


def test_the_nvme_tier_keeps_a_tensor_of_state_in_ram_and_the_rest_on_disk():
    fn = functools.partial(GPT, 2048, 32, 64, 2, 2, fused_attention=True)
    shape = GPTShape.of(fn)
    cand = Candidate(4, 1, offload=True, nvme=True)
    ram = run_plan(fn, Candidate(4, 1, offload=True), 4, 2)
    disk = run_plan(fn, cand, 4, 2)
    predicted = predict_memory(shape, cand)
    assert predicted.disk == 12 * shape.n_params
    assert disk.host_peak < 0.6 * ram.host_peak           # 4 B of gradients + one tensor's 12 B
    assert abs(disk.host_peak / predicted.host - 1) < 0.01, (disk.host_peak, predicted.host)


def test_levers_cost_time_where_they_should():
    shape, cost = GPTShape.of(FUSED), CostModel.for_device("cpu")
    base = predict_seconds(shape, Candidate(8), cost)
    assert predict_seconds(shape, Candidate(8, chunked_loss=8), cost)["recompute"] > 0
    assert predict_seconds(shape, Candidate(8, activation_offload=True), cost)[
        "activation offload"] > 0
    nvme = predict_seconds(shape, Candidate(8, offload=True, nvme=True), cost)
    assert nvme["disk"] > 0 and nvme["total"] > base["total"]


def test_the_nvme_tier_pays_its_bytes_and_a_flush_per_file():
    # master and two moments: three files per trainable tensor, each flushed (msync) each step,
    # and 12 B per parameter read and written; a flush-blind cost model (bytes only) ranked the
    # tier near free on the CPU, where 162 flushes took 150 ms of a 370 ms step
    shape = GPTShape.of(FUSED)
    assert shape.n_tensors == len(list(FUSED().parameters())) == 4 * 12 + 6
    cost = CostModel.for_device("cpu")
    disk = predict_seconds(shape, Candidate(8, offload=True, nvme=True), cost)["disk"]
    assert disk == pytest.approx(24 * shape.n_params / cost.disk_bandwidth
                                 + 3 * shape.n_tensors * cost.disk_sync_seconds)
    lora = predict_seconds(shape, Candidate(8, offload=True, nvme=True, lora_rank=4), cost)
    assert lora["disk"] == pytest.approx(24 * shape.lora_params(4) / cost.disk_bandwidth
                                         + 3 * 2 * 4 * 4 * cost.disk_sync_seconds)
    gpu = CostModel.for_gpu("H100 SXM")
    assert (gpu.disk_bandwidth, gpu.disk_sync_seconds) == (3e9, 1e-4)


def test_lever_validation_says_what_to_do():
    with pytest.raises(ValueError, match="offload=True"):
        Candidate(8, nvme=True)
    with pytest.raises(ValueError, match="slices"):
        Candidate(8, chunked_loss=-1)
    with pytest.raises(ValueError, match="main_grad|precision"):
        Candidate(8, precision="fp8")
