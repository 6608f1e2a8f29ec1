"""companion.session: the threads a chapter's kernel picks, its seeds, and every chapter calling it."""
import json
import pathlib
import random
import re

import pytest
import torch

from companion import session

COURSE = pathlib.Path(__file__).resolve().parent.parent / "course"


@pytest.mark.parametrize("cores, load, threads", [
    (1, 0.0, 1), (2, 0.0, 1), (2, 3.0, 1),          # 2 cores: one thread, quiet or busy
    (4, 0.0, 2), (8, 0.0, 4), (6, 0.0, 3),           # quiet: half the cores,
    (16, 0.5, 4), (64, 0.0, 4),                      # and 4 at most
    (8, 6.0, 1), (8, 4.5, 2), (16, 12.0, 3),         # busy: the idle cores less one
    (8, 20.0, 1),                                    # overloaded: still one
])
def test_threads_are_half_the_cores_at_most_and_leave_a_busy_machine_its_cores(cores, load, threads):
    assert session.choose_threads(cores, load) == threads


@pytest.mark.parametrize("cores, load", [(0, 0.0), (2.0, 0.0), (True, 0.0), (2, -1.0),
                                         (2, float("nan")), (2, "1")])
def test_threads_refuse_bad_input_with_a_message(cores, load):
    with pytest.raises(ValueError, match="cores|load"):
        session.choose_threads(cores, load)


@pytest.fixture
def no_cgroup(tmp_path, monkeypatch):
    """No cgroup files and no topology files: the tests below add what each needs."""
    monkeypatch.setattr(session, "_CGROUP_V2", tmp_path / "absent" / "cpu.max")
    monkeypatch.setattr(session, "_CGROUP_V1", tmp_path / "absent")
    monkeypatch.setattr(session, "_SELF_CGROUP", tmp_path / "absent" / "cgroup")
    monkeypatch.setattr(session, "_CPUS", tmp_path / "absent")
    monkeypatch.setattr(session, "_physical", lambda cpus: None)
    return tmp_path


def test_usable_cores_are_lowered_to_a_containers_quota(no_cgroup, monkeypatch):
    root = no_cgroup / "fs"
    (root / "user.slice").mkdir(parents=True)
    monkeypatch.setattr(session, "_CGROUP_V2", root / "cpu.max")
    monkeypatch.setattr(session.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    (root / "cpu.max").write_text("150000 100000\n")             # 1.5 CPUs -> 2 cores
    assert session.usable_cores() == 2
    (root / "cpu.max").write_text("max 100000\n")
    assert session.usable_cores() == 16
    (no_cgroup / "cgroup").write_text("0::/user.slice\n")          # this process's own group
    monkeypatch.setattr(session, "_SELF_CGROUP", no_cgroup / "cgroup")
    (root / "user.slice" / "cpu.max").write_text("300000 100000\n")
    assert session.usable_cores() == 3


def test_usable_cores_read_cgroup_v1_and_survive_no_cgroup(no_cgroup, monkeypatch):
    v1 = no_cgroup / "v1"
    v1.mkdir()
    monkeypatch.setattr(session, "_CGROUP_V1", v1)
    monkeypatch.setattr(session.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    assert session.usable_cores() == 4                          # no files: no quota
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert session.usable_cores() == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")               # v1's "no limit"
    assert session.usable_cores() == 4


def test_two_hyper_threads_of_one_core_count_once(tmp_path, monkeypatch):
    for cpu, core in enumerate((0, 1, 0, 1)):                   # a 2-core laptop, 4 threads
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(session, "_CPUS", tmp_path)
    assert session._physical({0, 1, 2, 3}) == 2
    assert session._physical({0, 2}) == 1                       # affinity to one core's threads
    monkeypatch.setattr(session.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(session, "_cgroup_cores", lambda: None)
    assert session.usable_cores() == 2
    assert session.choose_threads(session.usable_cores(), 0.0) == 1


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_start_picks_threads_from_cores_and_load_unless_set(monkeypatch, keep_threads, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(session, "usable_cores", lambda: 8)
    monkeypatch.setattr(session, "_load", lambda: 6.0)
    device, S = session.start(device="cpu")
    assert torch.get_num_threads() == 1 and device == torch.device("cpu")
    assert S.width == session.sizes("cpu").width
    assert "1 thread(s) on 8 core(s), load 6.0" in capsys.readouterr().out
    monkeypatch.setattr(session, "_load", lambda: 0.0)
    session.start(device="cpu", quiet=True)
    assert torch.get_num_threads() == 4                        # 8 idle cores: half
    monkeypatch.setenv("OMP_NUM_THREADS", "1")                   # what tasks.py test sets: kept
    torch.set_num_threads(3)
    session.start(device="cpu", quiet=True)
    assert torch.get_num_threads() == 3
    session.start(device="cpu", threads=2, quiet=True)           # an explicit count wins
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="threads"):
        session.start(threads=0)


def test_start_seeds_python_and_torch(keep_threads):
    session.start(seed=7, quiet=True)
    a = (random.random(), torch.rand(3))
    session.start(seed=7, quiet=True)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])
    session.start(seed=8, quiet=True)
    assert not torch.equal(torch.rand(3), a[1])


def test_the_plot_style_draws_overlapping_lines_in_different_dashes():
    import matplotlib as mpl
    session.plot_style()
    styles = [p["linestyle"] for p in mpl.rcParams["axes.prop_cycle"]]
    assert styles[:4] == ["-", "--", ":", "-."]


def test_progress_yields_every_item_in_order():
    assert list(session.progress(range(5), desc="t")) == [0, 1, 2, 3, 4]
    assert list(session.progress(iter("abc"), desc="t")) == ["a", "b", "c"]


@pytest.mark.parametrize("path", sorted(COURSE.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_every_chapter_starts_with_the_one_setup_call(path):
    cells = json.loads(path.read_text())["cells"]
    first = next("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert re.search(r"from companion.session import .*\bstart\b", first), path.name
    assert f"start(\"{path.name[:2]}\")" in first, "start(chapter) says which GPU runs are recorded"
    assert "set_num_threads" not in first, "threads are start()'s to choose"


def test_start_says_once_which_recorded_gpu_runs_the_chapter_has(tmp_path, monkeypatch, capsys,
                                                                 keep_threads):
    from companion import results
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path)
    session.start("05", quiet=False)
    assert "chapter 05: none ships with the course yet" in capsys.readouterr().out
    (tmp_path / "h100.json").write_text(json.dumps({
        "machine": "NVIDIA H100 80GB HBM3", "device": "cuda", "torch": "2.13.0", "cuda": "12.8",
        "date": "2026-12-01", "chapters": {"05": {"experiment": "amp"}}}))
    session.start("05")
    assert "chapter 05: NVIDIA H100 80GB HBM3 (2026-12-01)" in capsys.readouterr().out
    session.start("04")
    assert "chapter 04: none" in capsys.readouterr().out
