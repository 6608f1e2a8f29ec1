"""companion.launch: results by rank, clear errors for a rank that raises or hangs, no orphans."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from companion import launch


def _sum_ranks(rank, world_size, x):
    x += rank                       # each rank gets its own copy of x
    dist.all_reduce(x)
    return x, dist.get_backend()


def _rank_times_ten(rank, world_size):
    return 10 * rank


def _raise_on_rank_one(rank, world_size, pid_dir):
    _write_pid(pid_dir, rank)
    if rank == 1:
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # the others wait for rank 1 forever


def _hang_on_rank_zero(rank, world_size, pid_dir):
    _write_pid(pid_dir, rank)
    if rank == 0:
        time.sleep(60)
    dist.barrier()


def _exit_without_result(rank, world_size):
    if rank == 1:
        os._exit(7)
    return rank


def _unpicklable_result(rank, world_size):
    return lambda: rank


def _print_rank(rank, world_size):
    print(f"hello from {rank}")
    return rank


def _write_pid(folder, rank):
    """Atomically: a worker ended between creating the file and writing it leaves no empty file."""
    path = os.path.join(folder, f"{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def _assert_gone(folder, n):
    pids = [int(open(os.path.join(folder, f"{r}.pid")).read()) for r in range(n)
            if os.path.exists(os.path.join(folder, f"{r}.pid"))]
    assert pids, "the workers never started"
    deadline = time.monotonic() + 30        # they are killed already: this only polls for it
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            return
        time.sleep(0.05)
    pytest.fail(f"worker processes still alive: {alive}")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:            # a zombie is dead, only not yet reaped
        return f.read().split(")")[-1].split()[0] != "Z"


def test_results_come_back_in_rank_order_and_arguments_are_copied():
    x = torch.zeros(3)
    results = launch.run(_sum_ranks, 3, x, timeout=30)
    for tensor, backend in results:
        assert torch.equal(tensor, torch.full((3,), 3.0))   # 0 + 1 + 2
        assert backend == "gloo"
    assert torch.equal(x, torch.zeros(3))


def test_a_rank_that_raises_is_named_with_its_traceback_and_all_ranks_end(tmp_path):
    start = time.monotonic()
    with pytest.raises(launch.WorkerError) as info:
        launch.run(_raise_on_rank_one, 3, str(tmp_path), timeout=120)
    assert time.monotonic() - start < 60    # ended by the error, not at the deadline (0.2 s here)
    assert info.value.rank == 1
    assert "rank one is broken" in str(info.value) and "_raise_on_rank_one" in str(info.value)
    _assert_gone(tmp_path, 3)


def test_a_hanging_rank_is_ended_at_the_deadline_with_its_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(launch.WorkerTimeout) as info:
        launch.run(_hang_on_rank_zero, 2, str(tmp_path), timeout=2)
    assert time.monotonic() - start < 40    # at the deadline, not after the 60 s hang (2.3 s here)
    assert 0 in info.value.ranks
    assert "_hang_on_rank_zero" in info.value.stacks[0]
    _assert_gone(tmp_path, 2)


def test_a_rank_that_dies_without_a_result_is_reported():
    with pytest.raises(launch.WorkerError, match="rank 1"):
        launch.run(_exit_without_result, 2, timeout=20)


def test_an_unpicklable_result_is_reported_by_rank():
    with pytest.raises(launch.WorkerError, match="rank 0"):
        launch.run(_unpicklable_result, 1, timeout=20)


def test_functions_that_workers_cannot_import_fail_before_starting():
    with pytest.raises(TypeError, match="worker_module"):
        launch.run(lambda rank, world_size: rank, 2)
    with pytest.raises(ValueError):
        launch.run(_print_rank, 0)


def test_worker_output_is_printed_with_its_rank(capsys):
    assert launch.run(_print_rank, 2, timeout=20) == [0, 1]
    out = capsys.readouterr().out
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out


def test_gloo_without_a_gpu_per_rank():
    if torch.cuda.device_count() >= 64:
        pytest.skip("a machine with 64 GPUs")
    assert launch.pick_backend(64) == "gloo"


def test_worker_module_magic_makes_cell_functions_importable_by_workers():
    IPython = pytest.importorskip("IPython")
    shell = IPython.core.interactiveshell.InteractiveShell.instance()
    shell.run_line_magic("load_ext", "companion.launch")
    cell = "def doubled(rank, world_size):\n    return {factor} * rank\n"
    shell.run_cell_magic("worker_module", "ch06_test_cells", cell.format(factor=2))
    assert launch.run(shell.user_ns["doubled"], 2, timeout=20) == [0, 2]
    shell.run_cell_magic("worker_module", "ch06_test_cells", cell.format(factor=3))  # edited
    assert launch.run(shell.user_ns["doubled"], 2, timeout=20) == [0, 3]


def test_a_failure_to_join_the_group_is_retried_on_a_new_port(monkeypatch):
    calls = []
    real = launch._launch

    def flaky(*args):
        calls.append(args)
        if len(calls) == 1:                         # as gloo's connectFullMesh does, once
            raise launch._SetupError(1, "RuntimeError: Gloo connectFullMesh failed")
        return real(*args)
    monkeypatch.setattr(launch, "_launch", flaky)
    assert launch.run(_rank_times_ten, 2, timeout=20) == [0, 10]
    assert len(calls) >= 2       # retried (a busy machine's own gloo failure may add a try)


def test_a_group_that_never_forms_fails_after_the_retries_with_the_reason():
    with pytest.raises(launch.WorkerError, match="no-such-backend|Invalid backend"):
        launch.run(_rank_times_ten, 2, backend="no-such-backend", timeout=20)
