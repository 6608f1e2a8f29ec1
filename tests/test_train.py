"""companion.train (`python -m companion train`): real torchrun processes, and every parallel mode
training the same model to the same losses."""
import dataclasses
import subprocess
import sys

import pytest

from companion import launch, train
from companion.models import GPT

CONFIG = train.TrainConfig(steps=3, batch=4, seq_len=16, width=32, depth=2, heads=2, vocab=32,
                           accumulation=2, checkpointing=True)


def test_torchrun_two_gloo_ranks_print_peak_memory_and_step_time():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "companion", "train", "--parallel", "zero3", "--steps", "3",
               "--accumulation", "2", "--checkpointing", "--precision", "bf16",
               "--width", "32", "--seq-len", "16", "--vocab", "32"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("rank ")]
    assert [ln.split(":")[0] for ln in lines] == ["rank 0", "rank 1"]
    assert all("peak" in ln and " ms" in ln and "sent" in ln for ln in lines)


def _every_mode(rank, world_size):
    reports = {mode: train.train(dataclasses.replace(CONFIG, parallel=mode))
               for mode in ("ddp", "zero1", "zero2", "zero3")}
    bf16 = train.train(dataclasses.replace(CONFIG, parallel="zero2", precision="bf16"))
    return {m: r["losses"] for m, r in reports.items()}, bf16["losses"], \
        reports["zero3"]["model_states"]


def test_ddp_and_every_zero_stage_train_to_the_same_losses_and_states_include_gradients():
    gpt = GPT(CONFIG.vocab, CONFIG.seq_len, CONFIG.width, CONFIG.depth, CONFIG.heads)
    n = sum(p.numel() for p in gpt.parameters())
    n_1d = sum(p.numel() for p in gpt.parameters() if p.dim() < 2)
    tensors = sum(any(p.dim() >= 2 for p in m.parameters(recurse=False)) for m in gpt.modules()) \
        + sum(p.dim() < 2 for p in gpt.parameters())      # FSDP's flat shards + whole 1-D ones
    for losses, bf16, states in launch.run(_every_mode, 2, timeout=120):
        for mode in ("zero1", "zero2", "zero3"):
            assert losses[mode] == pytest.approx(losses["ddp"], rel=1e-5), mode
        assert bf16 == pytest.approx(losses["ddp"], rel=0.05)
        # fp32 AdamW: 16 B per parameter, the matrices' divided by N = 2, + a 4 B step each
        assert states == 16 * (n - n_1d) // 2 + 16 * n_1d + 4 * tensors


def test_one_process_without_torchrun_and_clear_option_errors(capsys):
    assert train.main(["--parallel", "zero1", "--steps", "2", "--width", "32", "--seq-len",
                       "16", "--vocab", "32"]) == 0
    assert "rank 0: peak" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train.parse(["--batch", "5", "--accumulation", "2"])
    assert "equal micro-batches" in capsys.readouterr().err


def test_ranks_map_onto_the_gpus_there_are_or_are_refused_clearly():
    assert train.backend_for(0, 2, 0) == ("gloo", None)            # no GPU: gloo on the CPU
    assert train.backend_for(1, 2, 2) == ("nccl", 1)               # one GPU per rank
    assert train.backend_for(0, 1, 8) == ("nccl", 0)
    with pytest.raises(SystemExit, match="2 ranks on this node, which has 1 GPU") as err:
        train.backend_for(1, 2, 1)                                 # two ranks, one GPU
    assert "--nproc_per_node=1" in str(err.value) and "CUDA_VISIBLE_DEVICES=" in str(err.value)
