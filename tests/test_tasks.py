"""tasks.py's setup: the README's torch commands pin the version setup installs, a torch of another
version in .venv is kept and named, and `lab` installs Triton where a wheel exists."""
import pathlib
import re
import sys

import pytest

import tasks

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_the_readme_installs_the_torch_that_tasks_installs():
    commands = re.findall(r"pip install (torch\S*)", (REPO / "README.md").read_text())
    assert len(commands) >= 2, "expected the README's CUDA and CPU torch commands"
    assert set(commands) == {tasks.TORCH}, f"README pins {commands}; tasks.TORCH is {tasks.TORCH}"


@pytest.fixture
def setup_runs(tmp_path, monkeypatch):
    """tasks.setup with a .venv that exists, a stamp that does not, and pip only recorded."""
    runs = []
    monkeypatch.setattr(tasks, "STAMP", tmp_path / ".setup-stamp")
    monkeypatch.setattr(tasks, "PYTHON", pathlib.Path(sys.executable))
    monkeypatch.setattr(tasks, "_run", lambda *cmd: runs.append([str(c) for c in cmd]))
    return runs


@pytest.mark.parametrize("there", ["2.14.1", "2.12.0+cu126"])
def test_setup_keeps_a_torch_of_another_version_and_says_how_to_switch(setup_runs, monkeypatch,
                                                                        capsys, there):
    monkeypatch.setattr(tasks, "_torch_version", lambda: there)
    tasks.setup(dev=False)                                   # no exception: it is kept
    out = capsys.readouterr().out
    wanted = tasks.TORCH.split("==")[1]
    assert f"PyTorch {there} is already in .venv: kept" in out
    assert f"stored outputs were made with PyTorch {wanted}" in out
    assert f"pip install {tasks.TORCH}" in out
    assert all(tasks.TORCH not in run for run in setup_runs)       # torch itself not touched
    assert tasks.STAMP.exists()


def test_setup_says_nothing_more_for_the_expected_torch_whatever_its_build(setup_runs,
                                                                          monkeypatch, capsys):
    monkeypatch.setattr(tasks, "_torch_version", lambda: tasks.TORCH.split("==")[1] + "+cpu")
    tasks.setup(dev=False)
    out = capsys.readouterr().out
    assert "already in .venv: kept" in out and "stored outputs" not in out


def test_setup_installs_the_pinned_torch_into_a_venv_without_one(setup_runs, monkeypatch):
    monkeypatch.setattr(tasks, "_torch_version", lambda: None)
    tasks.setup(dev=False)
    assert [run[-1] for run in setup_runs][0] == tasks.TORCH


def test_lab_installs_triton_where_a_wheel_exists():
    tomllib = pytest.importorskip("tomllib")                 # Python 3.11+
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    triton = [d for d in project["dependencies"] if d.startswith("triton")]
    assert triton and "platform_system == 'Linux'" in triton[0], (
        "Triton belongs in the base dependencies (what `lab` installs), with its Linux marker")
