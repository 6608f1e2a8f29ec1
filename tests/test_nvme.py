"""companion.nvme: the NVMe tier trains exactly like plain AdamW, pages one group at a time, and
never leaves files behind (on close, on error, on a failed step); bad directories fail clearly."""
import errno
import os

import pytest
import torch

from companion import nvme
from companion.estimate import offload_placement
from companion.memory import track
from companion.models import GPT, make_tokens
from companion.nvme import NVMeOffloadOptimizer, state_tensor_names


def _gpt():
    return GPT(32, 16, 32, 2, 4, seed=0)


def _groups(model):
    return [{"params": list(child.parameters())} for child in model.children()]


def _step(model, opt, seed=0):
    x, y = make_tokens(6, 16, vocab=32, seed=seed)
    loss = model.loss(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_state_tensor_names():
    assert state_tensor_names() == ["exp_avg", "exp_avg_sq"]
    assert state_tensor_names(torch.optim.AdamW, amsgrad=True) == [
        "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    assert state_tensor_names(torch.optim.SGD, lr=0.1, momentum=0.9) == ["momentum_buffer"]


def test_nvme_training_equals_plain_adamw_and_pages_one_group(tmp_path):
    plain, offloaded = _gpt(), _gpt()
    reference = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    with NVMeOffloadOptimizer(_groups(offloaded), directory=tmp_path, lr=1e-2,
                              weight_decay=0.1) as opt:
        n = sum(p.numel() for p in offloaded.parameters())
        assert opt.disk_bytes == 4 * n                     # the masters, before any step
        for step in range(3):
            with track("cpu") as t:
                assert _step(plain, reference, step) == _step(offloaded, opt, step)
        placed = offload_placement(n, zero_stage=2, offload_optimizer="nvme", convention="course",
                                   param_bytes=4)
        assert opt.disk_bytes == placed.disk == 12 * n
        largest = max(sum(p.numel() for p in g["params"]) for g in opt.param_groups)
        assert t.host_peak == 12 * largest and t.host_current == 0   # one group's page at a time
        assert len(os.listdir(opt.workdir)) == 3 * len(list(offloaded.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), offloaded.parameters()))
    assert os.listdir(tmp_path) == []


def test_close_removes_the_files(tmp_path):
    model = _gpt()
    opt = NVMeOffloadOptimizer(model.parameters(), directory=tmp_path)
    _step(model, opt)
    assert os.listdir(opt.workdir)
    opt.close()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="closed"):
        _step(model, opt)


def test_an_error_in_the_block_removes_the_files(tmp_path):
    model = _gpt()
    with pytest.raises(KeyError):
        with NVMeOffloadOptimizer(model.parameters(), directory=tmp_path) as opt:
            _step(model, opt)
            raise KeyError("boom")
    assert os.listdir(tmp_path) == []


def test_a_failed_step_removes_the_files(tmp_path, monkeypatch):
    model = _gpt()
    opt = NVMeOffloadOptimizer(model.parameters(), directory=tmp_path)
    _step(model, opt)

    def broken(*args, **kwargs):
        raise OSError(errno.EIO, "disk read failed")

    monkeypatch.setattr(opt.optimizer, "step", broken)
    with pytest.raises(OSError, match="disk read failed"):
        _step(model, opt)
    assert opt.closed and os.listdir(tmp_path) == []


def test_a_failed_construction_leaves_no_files(tmp_path):
    with pytest.raises(ValueError, match="requires grad"):
        NVMeOffloadOptimizer([torch.zeros(3)], directory=tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("settings, message", [({"lr": "x"}, "rejects the settings"),
                                               ({"lrr": 1e-3}, "lrr")])
def test_bad_settings_fail_clearly_and_leave_no_files(tmp_path, settings, message):
    with pytest.raises(TypeError, match=message):
        NVMeOffloadOptimizer(_gpt().parameters(), directory=tmp_path, **settings)
    assert os.listdir(tmp_path) == []


def test_no_directory_fails_clearly():
    with pytest.raises(TypeError, match="directory must be a path"):
        NVMeOffloadOptimizer(_gpt().parameters(), directory=None)


def test_a_missing_directory_fails_clearly(tmp_path):
    with pytest.raises(NotADirectoryError, match="does not exist"):
        NVMeOffloadOptimizer(_gpt().parameters(), directory=tmp_path / "nowhere")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        NVMeOffloadOptimizer(_gpt().parameters(), directory=tmp_path / "a_file")


def test_an_unwritable_directory_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(nvme.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match="cannot write"):
        NVMeOffloadOptimizer(_gpt().parameters(), directory=tmp_path)
    monkeypatch.undo()

    def refuse(*args, **kwargs):                           # what mkdtemp does on a read-only disk
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(nvme.tempfile, "mkdtemp", refuse)
    with pytest.raises(PermissionError, match="Read-only file system"):
        NVMeOffloadOptimizer(_gpt().parameters(), directory=tmp_path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root may write anywhere; the monkeypatched test covers this case")
def test_a_read_only_directory_fails_clearly(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="cannot write"):
            NVMeOffloadOptimizer(_gpt().parameters(), directory=tmp_path)
    finally:
        tmp_path.chmod(0o700)


def test_a_disk_too_small_fails_clearly_before_writing(tmp_path, monkeypatch):
    model = _gpt()
    n = sum(p.numel() for p in model.parameters())
    monkeypatch.setattr(nvme, "_free_bytes", lambda directory: 12 * n - 1)
    with pytest.raises(OSError, match="needs .* free") as failure:
        NVMeOffloadOptimizer(model.parameters(), directory=tmp_path)
    assert failure.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []
    monkeypatch.setattr(nvme, "_free_bytes", lambda directory: 12 * n)
    NVMeOffloadOptimizer(model.parameters(), directory=tmp_path).close()


def test_an_added_param_group_is_paged_and_trained_like_adamw(tmp_path):
    plain, offloaded = _gpt(), _gpt()
    first = lambda m: list(m.children())[0].parameters()
    rest = lambda m: [p for c in list(m.children())[1:] for p in c.parameters()]
    reference = torch.optim.AdamW(first(plain), lr=1e-2, fused=True)
    with NVMeOffloadOptimizer(first(offloaded), directory=tmp_path, lr=1e-2) as opt:
        assert _step(plain, reference, 0) == _step(offloaded, opt, 0)
        for o, m in ((reference, plain), (opt, offloaded)):
            o.add_param_group({"params": rest(m), "lr": 3e-3})
        for step in range(1, 3):
            assert _step(plain, reference, step) == _step(offloaded, opt, step)
        assert opt.disk_bytes == 12 * sum(p.numel() for p in offloaded.parameters())
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), offloaded.parameters()))
