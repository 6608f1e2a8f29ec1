"""`companion.explain` on snapshots built to the format `torch.cuda.memory._snapshot` documents:
a training step (model moved before the recording, forward, backward, AdamW's first step) whose
bytes by kind are known, and the command line."""
import pickle
import subprocess
import sys

import pytest

from companion.explain import explain, format_explanation

MiB = 2**20
_OPT = [{"filename": "/x/site-packages/torch/optim/adamw.py", "line": 1, "name": "_init_group"}]
_BACK = [{"filename": "/x/site-packages/torch/autograd/__init__.py", "line": 1,
          "name": "_engine_run_backward"}, {"filename": "/me/train.py", "line": 9, "name": "step"}]
_FWD = [{"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 1, "name": "forward"},
        {"filename": "/me/train.py", "line": 8, "name": "step"}]
_MOVE = [{"filename": "/x/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_apply"}]


def _step_snapshot(*, fragmented: bool = False):
    """weights 8 MiB before recording + 4 MiB moved in; forward saves 10 MiB; backward makes 12
    MiB of gradients and a 6 MiB temporary (freed in backward), frees activations; AdamW 24 MiB."""
    trace, addr, alive = [], [1 << 30], {}

    def alloc(size, frames):
        a = addr[0]
        addr[0] += size
        trace.append({"action": "alloc", "addr": a, "size": size, "stream": 0, "frames": frames})
        alive[a] = (size, frames)
        return a

    def free(a, size):
        trace.append({"action": "free_requested", "addr": a, "size": size, "stream": 0})
        trace.append({"action": "free_completed", "addr": a, "size": size, "stream": 0})
        del alive[a]

    trace.append({"action": "segment_alloc", "addr": 1 << 30, "size": 80 * MiB, "stream": 0})
    alloc(4 * MiB, _MOVE)
    acts = [alloc(5 * MiB, _FWD) for _ in range(2)]
    temp = alloc(6 * MiB, _BACK)                      # the loss's gradient
    grads = [alloc(6 * MiB, _BACK)]                   # the peak: 4 + 10 + 6 + 6 = 26 traced
    free(temp, 6 * MiB)
    free(acts[1], 5 * MiB)
    grads.append(alloc(6 * MiB, _BACK))
    free(acts[0], 5 * MiB)
    alloc(12 * MiB, _OPT)
    alloc(12 * MiB, _OPT)                             # 4 + 12 + 24 = 40: the peak
    blocks = [{"size": 8 * MiB, "requested_size": 8 * MiB, "address": 0,
               "state": "active_allocated", "frames": []}]
    free_blocks = ([{"size": MiB, "address": 8 * MiB + i * 2 * MiB, "state": "inactive",
                     "frames": []} for i in range(6)] if fragmented else
                   [{"size": 6 * MiB, "address": 8 * MiB, "state": "inactive", "frames": []}])
    segments = [{"address": 0, "total_size": 20 * MiB, "allocated_size": 8 * MiB,
                 "active_size": 8 * MiB, "stream": 0, "segment_type": "large",
                 "blocks": blocks + free_blocks},
                {"address": 1 << 30, "total_size": 80 * MiB, "allocated_size": 40 * MiB,
                 "active_size": 40 * MiB, "stream": 0, "segment_type": "large",
                 "blocks": [{"size": size, "address": a, "state": "active_allocated",
                             "frames": frames} for a, (size, frames) in alive.items()]}]
    return {"segments": segments, "device_traces": [trace]}


def test_the_optimizer_peak_is_filed_by_kind():
    found = explain(_step_snapshot())
    assert found["phase"] == "optimizer"
    assert found["kinds"] == {"parameters": 12 * MiB, "gradients": 12 * MiB,
                              "optimizer_state": 24 * MiB, "activations": 0, "temporaries": 0}
    assert found["peak"] == 48 * MiB == sum(found["kinds"].values())
    assert found["cache"] == 100 * MiB - 48 * MiB
    assert found["levers"][0].startswith("optimizer state")


def test_a_backward_peak_keeps_activations_and_the_temporary_apart():
    snap = _step_snapshot()
    snap["device_traces"][0] = [e for e in snap["device_traces"][0]
                                if "torch/optim" not in str(e.get("frames"))]
    found = explain(snap)
    assert found["phase"] == "backward"
    assert found["kinds"]["activations"] == 10 * MiB
    assert found["kinds"]["temporaries"] == 6 * MiB and found["kinds"]["gradients"] == 6 * MiB
    assert [lever.split(":")[0] for lever in found["levers"]] == [
        "parameters", "activations", "gradients"]              # the three largest, in order


def test_fragmentation_adds_the_allocator_setting():
    found = explain(_step_snapshot(fragmented=True))
    assert found["fragmentation"] > 0.3 and "expandable_segments" in found["levers"][-1]
    text = format_explanation(found)
    assert "optimizer state" in text and "48.00 MiB" in text


def test_bad_snapshots_get_a_message():
    with pytest.raises(ValueError, match="not a CUDA memory snapshot"):
        explain([1, 2])
    with pytest.raises(ValueError, match="no trace"):
        explain({"segments": [], "device_traces": [[]]})


def test_command_line(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(_step_snapshot()))
    out = subprocess.run([sys.executable, "-m", "companion", "explain", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "in optimizer" in out.stdout and "cheapest levers" in out.stdout
    (tmp_path / "junk.pickle").write_bytes(b"not a pickle")
    bad = subprocess.run([sys.executable, "-m", "companion", "explain",
                          str(tmp_path / "junk.pickle")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "junk.pickle" in bad.stderr
