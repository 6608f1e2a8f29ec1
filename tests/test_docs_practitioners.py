"""docs/PRACTITIONERS.md shows real output: each `$ python -m companion ...` block and the Python
block are run again here, and every output line the page shows must come out, in order ("..."
stands for lines the page leaves out). The planner's output on a GPU is deterministic (fake
tensors, the cost table's rates), so a changed number is a changed planner: re-run the command
and update the page."""
import hashlib
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

REPO = pathlib.Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "PRACTITIONERS.md").read_text()
COMMANDS = re.findall(r"```\n\$ (python -m companion [^\n]+)\n(.*?)\n```", PAGE, re.S)
PYTHON = re.search(r"```python\n(.*?)\n```\n```\n(.*?)\n```", PAGE, re.S)
# the public snapshot question 5 reads (kkaitlyn111/cs336-a2-systems, by git blob id)
CS336_FULLSTEP = "86060152724b911d54dbdf957eea94b1a3d6a74e"


def _shown_in_order(shown: str, got: str) -> None:
    lines, at = got.splitlines(), 0
    for want in shown.splitlines():
        if want == "...":
            continue
        try:
            at = lines.index(want, at) + 1
        except ValueError:
            raise AssertionError(f"the page shows {want!r}, which the command no longer prints "
                                 f"(from line {at} on):\n{got}") from None


def _snapshot(name: str) -> pathlib.Path:
    folder = os.environ.get("COMPANION_SNAPSHOTS")
    if not folder:
        pytest.skip("set COMPANION_SNAPSHOTS to a folder holding the public snapshots")
    for path in sorted(pathlib.Path(folder).iterdir()):
        data = path.read_bytes() if path.is_file() else b""
        if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == CS336_FULLSTEP:
            return path
    pytest.skip(f"{name} is not in {folder}")


def test_the_page_has_its_five_questions_answered_by_commands():
    assert len(COMMANDS) == 6 and PYTHON is not None
    for question in ("Will it fit", "Why did it run out", "Which lever", "How fast",
                     "What does this snapshot say"):
        assert f"## " in PAGE and question in PAGE


@pytest.mark.slow
@pytest.mark.timeout(1200)          # a Qwen3-0.6B plan: 45-130 s alone, more beside 3 workers
@pytest.mark.parametrize("command, shown", COMMANDS, ids=[f"block{i}" for i in range(len(COMMANDS))])
def test_each_command_prints_what_the_page_shows(command, shown):
    args = shlex.split(command)[1:]                      # after "python"
    if args[:2] == ["-m", "companion"] and args[2] == "explain":
        args[3] = str(_snapshot(args[3]))
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    _shown_in_order(shown, out.stdout)


def test_the_lora_example_loads_in_peft_with_the_same_logits(tmp_path):
    code, shown = PYTHON.groups()
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == shown.strip()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
