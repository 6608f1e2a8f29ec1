"""companion.dp: the one-process DataParallel steps like one model on the full batch."""
import copy

import pytest
import torch
from torch import nn

from companion import dp


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, torch.randn(11, 5), torch.randn(11, 3)     # 11 rows: uneven slices


@pytest.mark.parametrize("n_replicas", [1, 2, 3, 4])
def test_matches_one_model_on_the_full_batch(n_replicas):
    model, x, y = _setup()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    parallel = dp.DataParallel(model, n_replicas=n_replicas)
    for _ in range(3):
        loss = parallel.train_step(x, y, nn.functional.mse_loss, opt)
        ref_loss = nn.functional.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want)


def test_report_accounts_the_master_extra_bytes_and_every_phase():
    model, x, y = _setup()
    parallel = dp.DataParallel(model, n_replicas=3)
    parallel.train_step(x, y, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    report = parallel.last_report
    assert set(report.seconds) == set(dp.PHASES) and all(s >= 0 for s in report.seconds.values())
    params = sum(p.numel() * 4 for p in model.parameters())
    outputs = 11 * 3 * 4                                       # the gathered (11, 3) outputs
    master = report.master_bytes
    assert (master["batch"], master["gather"], master["reduce"]) == (11 * 5 * 4 + outputs, outputs,
                                                                      params)
    assert master["loss"] >= outputs + 4                       # the outputs kept, plus the loss
    assert report.master_extra_bytes == master["batch"] + max(master["loss"], params)
    assert len(report.replica_bytes) == 3
    # a replica with 4 rows saves more activations than one with 3 (slices of 4, 4, 3)
    assert report.replica_bytes[0] == report.replica_bytes[1] > report.replica_bytes[2] > params


@pytest.mark.gpu
def test_matches_torch_data_parallel_on_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    model, x, y = _setup()
    model = model.cuda()
    theirs = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    their_opt = torch.optim.SGD(theirs.parameters(), lr=0.1)
    dp.DataParallel(model, devices=["cuda:0", "cuda:1"]).train_step(
        x, y, nn.functional.mse_loss, opt)
    nn.functional.mse_loss(nn.DataParallel(theirs, device_ids=[0, 1])(x.cuda()), y.cuda()).backward()
    their_opt.step()
    for got, want in zip(model.parameters(), theirs.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_master_holds_the_whole_batch_whatever_the_replica_count():
    model, x, y = _setup()
    extra, replica = {}, {}
    for n in (1, 2, 4):
        parallel = dp.DataParallel(copy.deepcopy(model), n_replicas=n)
        parallel.train_step(x.repeat(8, 1), y.repeat(8, 1), nn.functional.mse_loss,
                            torch.optim.SGD(parallel.module.parameters(), lr=0.1))
        extra[n], replica[n] = parallel.last_report.master_extra_bytes, parallel.last_report.replica_bytes
    assert extra[1] == extra[2] == extra[4]                   # the master's extra does not shrink
    assert replica[4][0] < replica[2][0] < replica[1][0]       # each replica's share does
