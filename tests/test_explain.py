"""`companion.explain` on snapshots built to the format `torch.cuda.memory._snapshot` documents,
with the stacks real snapshots carry, and on three public snapshots when they are given.

The frames below are abridged from three public snapshots recorded with torch's default
stacks="all" (git blob ids in `_PUBLIC`): kkaitlyn111/cs336-a2-systems
memory_files/memory_ctx128_fullstep.pickle (events 4656: forward, 4692: loss.backward's seed,
4693: the engine thread, 16748: the optimizer), JasperSolt/EoR_NN snapshot.pickle (575, 577: Adam;
1162: zero_grad's free) and cranberrii/ftcourse memory_snapshot.pickle. A block made in backward
carries only C++ frames, down to the autograd engine's thread (pytorch/pytorch#82146: "things
allocated during the backward pass have no stack frames because they are run on another C++
thread"); with stacks="python" the same block has no frame at all, and every other event keeps
only its Python frames (`_python_only`)."""
import copy
import hashlib
import os
import pathlib
import pickle
import subprocess
import sys

import pytest
import torch

from companion.__main__ import main
from companion.explain import explain, format_explanation, load_snapshot

MiB = 2**20
_SITE = "/env/lib/python3.13/site-packages"


def _cpp(name: str, filename: str = "??") -> dict:
    return {"filename": filename, "line": 0, "name": name}


def _py(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


_ALLOCATOR = [_cpp("torch::unwind::unwind()"),
              _cpp("torch::CapturedTraceback::gather(bool, bool, bool)"),
              _cpp("torch::cuda::(anonymous namespace)::gather_with_cpp()", "memory_snapshot.cpp"),
              _cpp("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc("
                   "signed char, unsigned long, CUstream_st*)", "CUDACachingAllocator.cpp"),
              _cpp("at::detail::empty_cuda(c10::ArrayRef<long>, c10::TensorOptions const&)")]
_MAIN = [_cpp("_PyEval_EvalFrameDefault"), _cpp("Py_RunMain"), _cpp("__libc_start_main"),
         _cpp("_start")]
_SCRIPT = [_py("/home/me/train.py", 231, "train_step"), _py("/home/me/train.py", 441, "<module>")]
_FRAMES = {
    "forward": _ALLOCATOR + [
        _cpp("torch::autograd::THPVariable_einsum(_object*, _object*, _object*)",
             "python_torch_functions_0.cpp"),
        _py(f"{_SITE}/torch/functional.py", 407, "einsum"),
        _py("/home/me/model.py", 22, "forward"), *_MAIN,
        _py(f"{_SITE}/torch/nn/modules/module.py", 1750, "_call_impl"), *_SCRIPT],
    "seed": _ALLOCATOR + [                         # loss.backward() makes its ones on the caller
        _cpp("torch::autograd::THPVariable_ones_like(_object*, _object*, _object*)",
             "python_torch_functions_1.cpp"),
        _py(f"{_SITE}/torch/autograd/__init__.py", 220, "_make_grads"), *_MAIN,
        _py(f"{_SITE}/torch/autograd/__init__.py", 340, "backward"),
        _py(f"{_SITE}/torch/_tensor.py", 626, "backward"), *_SCRIPT],
    "engine": _ALLOCATOR + [
        _cpp("at::_ops::bmm::call(at::Tensor const&, at::Tensor const&)"),
        _cpp("torch::autograd::generated::BmmBackward0::apply(std::vector<at::Tensor, "
             "std::allocator<at::Tensor> >&&)"),
        _cpp("torch::autograd::Node::operator()(std::vector<at::Tensor, "
             "std::allocator<at::Tensor> >&&)", ""),
        _cpp("torch::autograd::Engine::evaluate_function(std::shared_ptr<torch::autograd::"
             "GraphTask>&, torch::autograd::Node*, torch::autograd::InputBuffer&, std::s"),
        _cpp("torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> "
             "const&)"),
        _cpp("torch::autograd::Engine::thread_init(int, std::shared_ptr<torch::autograd::"
             "ReadyQueue> const&, bool)"),
        _cpp("torch::autograd::python::PythonEngine::thread_init(int, std::shared_ptr<torch::"
             "autograd::ReadyQueue> const&, bool)"),
        _cpp("execute_native_thread_routine", "thread48.o")],
    "optimizer": _ALLOCATOR + [
        _cpp("torch::autograd::THPVariable_zeros_like(_object*, _object*, _object*)",
             "python_torch_functions_0.cpp"),
        _py(f"{_SITE}/torch/optim/adam.py", 111, "_init_group"),
        _py(f"{_SITE}/torch/optim/adam.py", 157, "step"), *_MAIN,
        _py(f"{_SITE}/torch/optim/optimizer.py", 385, "wrapper"), *_SCRIPT],
    "foreach": _ALLOCATOR + [
        _cpp("torch::autograd::THPVariable__foreach_sqrt(_object*, _object*, _object*)",
             "python_torch_functions_1.cpp"),
        _py(f"{_SITE}/torch/optim/adam.py", 579, "_multi_tensor_adam"),
        _py(f"{_SITE}/torch/optim/adam.py", 166, "step"), *_MAIN,
        _py(f"{_SITE}/torch/optim/optimizer.py", 385, "wrapper"), *_SCRIPT],
    "zero_grad": [_cpp("THPVariable_set_grad(THPVariable*, _object*, void*)"),
                  _py(f"{_SITE}/torch/optim/optimizer.py", 820, "zero_grad"), *_MAIN, *_SCRIPT],
    "move": _ALLOCATOR + [_py(f"{_SITE}/torch/nn/modules/module.py", 1341, "_apply"),
                          _py(f"{_SITE}/torch/nn/modules/module.py", 1355, "to"), *_MAIN,
                          *_SCRIPT],
    # stacks="python" only (torch/utils/checkpoint.py): the engine thread unpacks a saved tensor
    # of a checkpointed layer by running the layer again from the unpack hook
    "recompute": _ALLOCATOR + [_py("/home/me/model.py", 22, "forward"),
                               _py(f"{_SITE}/torch/utils/checkpoint.py", 1657, "recompute_fn"),
                               _py(f"{_SITE}/torch/utils/checkpoint.py", 1165, "unpack_hook")],
}


def _python_only(frames: list[dict]) -> list[dict]:
    """What stacks="python" records of the same stack: its Python frames (none on the engine's
    thread)."""
    return [f for f in frames if f["filename"].endswith(".py")]


class _Trace:
    """A trace written event by event, each with the frames of `_FRAMES[where]`."""

    def __init__(self, stacks: str):
        self.events, self.alive, self.next, self.stacks = [], {}, 1 << 30, stacks

    def _frames(self, where: str) -> list[dict]:
        frames = _FRAMES[where]
        return _python_only(frames) if self.stacks == "python" else list(frames)

    def alloc(self, size: int, where: str) -> int:
        addr, self.next = self.next, self.next + size
        self.events.append({"action": "alloc", "addr": addr, "size": size, "stream": 0,
                            "frames": self._frames(where)})
        self.alive[addr] = size
        return addr

    def free(self, addr: int, where: str):
        size = self.alive.pop(addr)
        for action in ("free_requested", "free_completed"):
            self.events.append({"action": action, "addr": addr, "size": size, "stream": 0,
                                "frames": self._frames(where)})

    def snapshot(self, *, fragmented: bool = False) -> dict:
        """Weights made before the recording (8 MiB) in a segment of their own, the traced
        blocks in an 80 MiB segment."""
        blocks = [{"size": 8 * MiB, "requested_size": 8 * MiB, "address": 0,
                   "state": "active_allocated", "frames": []}]
        blocks += ([{"size": MiB, "address": 8 * MiB + i * 2 * MiB, "state": "inactive",
                     "frames": []} for i in range(6)] if fragmented else
                   [{"size": 6 * MiB, "address": 8 * MiB, "state": "inactive", "frames": []}])
        live = sum(self.alive.values())
        segments = [{"address": 0, "total_size": 20 * MiB, "allocated_size": 8 * MiB,
                     "active_size": 8 * MiB, "stream": 0, "segment_type": "large",
                     "blocks": blocks},
                    {"address": 1 << 30, "total_size": 80 * MiB, "allocated_size": live,
                     "active_size": live, "stream": 0, "segment_type": "large",
                     "blocks": [{"size": size, "address": a, "state": "active_allocated",
                                 "frames": []} for a, size in self.alive.items()]}]
        trace = [{"action": "segment_alloc", "addr": 1 << 30, "size": 80 * MiB, "stream": 0,
                  "frames": []}] + self.events
        return {"segments": segments, "device_traces": [trace]}


def _step(stacks: str = "all", *, optimizer: bool = True, held: int = 0,
          seed: bool = True) -> _Trace:
    """A training step: 4 MiB of weights moved in; forward saves 10 MiB (and `held` MiB of
    output the loop keeps); backward's seed (none for loss.backward(gradient)) and a 7 MiB
    temporary, 12 MiB of gradients, the saved tensors freed; AdamW's first step: 24 MiB of state
    and a 6 MiB foreach intermediate (the peak: 4 + held + 12 + 24 + 6 traced)."""
    t = _Trace(stacks)
    t.alloc(4 * MiB, "move")
    acts = [t.alloc(5 * MiB, "forward") for _ in range(2)]
    if held:
        t.alloc(held * MiB, "forward")
    seeded = t.alloc(4, "seed") if seed else None
    temp = t.alloc(7 * MiB, "engine")
    grads = [t.alloc(6 * MiB, "engine")]                # a backward peak: 4 + 10 + 7 + 6 (+4 B)
    t.free(temp, "engine")
    t.free(acts[1], "engine")
    grads.append(t.alloc(6 * MiB, "engine"))
    t.free(acts[0], "engine")
    if seeded:
        t.free(seeded, "seed")
    if optimizer:
        t.alloc(12 * MiB, "optimizer")
        t.alloc(12 * MiB, "optimizer")
        scratch = t.alloc(6 * MiB, "foreach")
        t.free(scratch, "foreach")
    return t


_STACKS = [("all", True), ("python", True), ("python", False)]


@pytest.mark.parametrize("stacks, seed", _STACKS)
def test_the_optimizer_peak_is_filed_by_kind(stacks, seed):
    found = explain(_step(stacks, seed=seed).snapshot())
    assert found["phase"] == "optimizer"
    assert found["kinds"] == {"parameters": 12 * MiB, "gradients": 12 * MiB,
                              "optimizer_state": 24 * MiB, "activations": 0,
                              "temporaries": 6 * MiB}
    assert found["peak"] == 54 * MiB == sum(found["kinds"].values())
    assert found["cache"] == 100 * MiB - 54 * MiB
    assert found["levers"][0].startswith("optimizer state")
    assert not any("checkpointing" in lever for lever in found["levers"])


@pytest.mark.parametrize("stacks, seed", _STACKS)
def test_a_backward_peak_keeps_activations_and_the_temporary_apart(stacks, seed):
    found = explain(_step(stacks, optimizer=False, seed=seed).snapshot())
    assert found["phase"] == "backward"
    assert found["kinds"] == {"parameters": 12 * MiB, "gradients": 6 * MiB,
                              "optimizer_state": 0, "activations": 10 * MiB,
                              "temporaries": 7 * MiB + (4 if seed else 0)}
    assert [lever.split(":")[0] for lever in found["levers"]] == [
        "parameters", "activations", "backward's temporaries"]   # the three largest, in order


def test_outputs_held_at_the_optimizer_step_do_not_get_checkpointing():
    found = explain(_step(held=40).snapshot())
    assert found["phase"] == "optimizer" and found["kinds"]["activations"] == 40 * MiB
    assert found["levers"][0].startswith("tensors from forward still alive at the optimizer step")
    assert not any("checkpointing (chapter 04)" in lever for lever in found["levers"])
    backward = _step(held=40, optimizer=False)            # the same bytes at a backward peak
    assert explain(backward.snapshot())["levers"][0].startswith("activations: checkpointing")


@pytest.mark.parametrize("stacks", ["all", "python"])
def test_gradients_freed_by_zero_grad_are_not_backward_temporaries(stacks):
    """SGD's in-place step allocates nothing, so nothing but zero_grad's frees (torch/optim
    frames) says backward has ended before the gradients go."""
    t = _Trace(stacks)
    t.alloc(10 * MiB, "forward")
    grads = [t.alloc(6 * MiB, "engine") for _ in range(2)]
    for g in grads:
        t.free(g, "zero_grad")
    t.alloc(MiB, "forward")
    found = explain(t.snapshot())
    assert found["phase"] == "backward" and found["kinds"]["gradients"] == 12 * MiB


def test_recomputation_on_the_engine_thread_is_a_temporary_of_backward():
    t = _Trace("python")
    act = t.alloc(2 * MiB, "forward")
    redo = t.alloc(8 * MiB, "recompute")                 # a checkpointed layer run again: the peak
    t.free(redo, "engine")
    t.alloc(MiB, "engine")                               # a gradient, made after the peak
    t.free(act, "engine")
    t.alloc(MiB, "optimizer")
    found = explain(t.snapshot())
    assert found["phase"] == "backward"
    assert found["kinds"]["temporaries"] == 8 * MiB and found["kinds"]["activations"] == 2 * MiB


def test_a_copy_freed_while_the_model_moves_is_a_temporary():
    t = _Trace("all")
    old = t.alloc(8 * MiB, "move")                       # fp32 weights
    t.alloc(4 * MiB, "move")                             # their bf16 copy: the peak
    t.free(old, "move")
    t.alloc(MiB, "forward")
    found = explain(t.snapshot())
    assert found["phase"] == "model"
    assert found["kinds"]["temporaries"] == 8 * MiB and found["kinds"]["parameters"] == 12 * MiB
    assert found["levers"][1].startswith("the model's temporaries")


def test_fragmentation_adds_the_allocator_setting():
    found = explain(_step().snapshot(fragmented=True))
    assert found["fragmentation"] > 0.3 and "expandable_segments" in found["levers"][-1]
    text = format_explanation(found)
    assert "optimizer state" in text and "54.00 MiB" in text


def test_bad_snapshots_get_a_message():
    with pytest.raises(ValueError, match="not a CUDA memory snapshot"):
        explain([1, 2])
    with pytest.raises(ValueError, match="no trace"):
        explain({"segments": [], "device_traces": [[]]})
    snap = _step().snapshot()
    for e in snap["device_traces"][0]:
        e["frames"] = []
    with pytest.raises(ValueError, match="no Python stack frames"):
        explain(snap)


def test_an_oom_entry_has_no_addr_and_is_read():
    """torch.cuda.memory._snapshot's TraceEntry: "addr: int  # not present for OOM"."""
    snap = _step().snapshot()
    snap["device_traces"][0].append({"action": "oom", "size": 64 * MiB, "device_free": MiB,
                                     "stream": 0, "frames": []})
    assert explain(snap)["kinds"] == explain(_step().snapshot())["kinds"]


class _Payload:
    """Unpickling this calls open(path, "w"): code in the file, run by a plain pickle.load."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _run(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "companion", "explain", str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_code_in_the_file_is_refused_not_run(tmp_path, protocol):
    ran = tmp_path / "ran"
    data = pickle.dumps({"segments": [], "device_traces": [[]], "x": _Payload(ran)},
                        protocol=protocol)
    with pytest.raises(ValueError, match=r"not a CUDA memory snapshot \(the file holds code"):
        load_snapshot(data)
    path = tmp_path / "evil.pickle"
    path.write_bytes(data)
    out = _run(path)
    assert not ran.exists()
    assert out.returncode == 2 and "holds code" in out.stderr and "Traceback" not in out.stderr
    pickle.loads(data)                                    # the known-wrong reader: it runs
    assert ran.exists()


def _not_snapshots(tmp_path) -> dict[str, pathlib.Path]:
    files = {"empty": b"", "json": b'{"segments": []}\n',
             "truncated": pickle.dumps(_step().snapshot())[:500],
             "list": pickle.dumps([1, 2, 3])}
    snap = _step().snapshot()
    del snap["device_traces"][0][3]["addr"]
    files["trace_without_addr"] = pickle.dumps(snap)
    paths = {name: tmp_path / f"{name}.pickle" for name in files}
    for name, data in files.items():
        paths[name].write_bytes(data)
    paths["torch_save"] = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(3)}, paths["torch_save"])
    paths["torch_save_legacy"] = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, paths["torch_save_legacy"],
               _use_new_zipfile_serialization=False)
    return paths


def test_what_is_not_a_snapshot_gets_one_clear_line(tmp_path, capsys):
    for name, path in _not_snapshots(tmp_path).items():
        assert main(["explain", str(path)]) == 2, name     # an exception would fail the test
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, (name, lines)
        assert lines[0].startswith(f"companion explain: {path}: not a CUDA memory snapshot ("), \
            (name, lines)


def test_command_line(tmp_path):
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(_step().snapshot()))
    out = _run(path)
    assert out.returncode == 0, out.stderr
    assert "in optimizer" in out.stdout and "cheapest levers" in out.stdout
    assert _run(tmp_path / "missing.pickle").returncode == 2


# The public snapshots, by git blob id (`git hash-object`), read from $COMPANION_SNAPSHOTS (a
# folder holding them under any name: fetch the repositories, then `git show HEAD:<path>`).
_PUBLIC = {
    # kkaitlyn111/cs336-a2-systems memory_files/memory_ctx128_fullstep.pickle and _forward.pickle
    "cs336_fullstep": "86060152724b911d54dbdf957eea94b1a3d6a74e",
    "cs336_forward": "919955740df0e199d2dea08f7ed0897a84ddb330",
    "eor_nn": "6720e24954435398d66f13cb8652dbb0d6d53f5e",  # JasperSolt/EoR_NN snapshot.pickle
    # cranberrii/ftcourse memory_snapshot.pickle (QLoRA on a Llama: forward and backward)
    "ftcourse_qlora": "ffe2e0c45d4480cf2bd1ca6415ce4a76e02cdabd",
}


def _public(name: str) -> dict:
    folder = os.environ.get("COMPANION_SNAPSHOTS")
    if not folder:
        pytest.skip("set COMPANION_SNAPSHOTS to a folder holding the public snapshots")
    for path in sorted(pathlib.Path(folder).iterdir()):
        data = path.read_bytes() if path.is_file() else b""
        if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == _PUBLIC[name]:
            return load_snapshot(data)
    pytest.skip(f"{name} (blob {_PUBLIC[name]}) is not in {folder}")


def _replay_by_maker(snapshot: dict) -> tuple[int, dict[str, int]]:
    """An independent replay: the traced bytes at the peak, and the blocks alive then by who made
    them ("engine": an autograd-engine frame or loss.backward's seed, "optim": a torch/optim
    frame, "python": any other)."""
    def maker(frames):
        if any("autograd::Engine::" in f["name"] for f in frames) or any(
                f["filename"].endswith("torch/autograd/__init__.py") for f in frames):
            return "engine"
        return "optim" if any("/torch/optim/" in f["filename"] for f in frames) else "python"
    live, now, peak, at_peak = {}, 0, 0, {}
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], maker(e["frames"]))
            now += e["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    by = dict.fromkeys(("engine", "optim", "python"), 0)
    for size, who in at_peak.values():
        by[who] += size
    return peak, by


@pytest.mark.parametrize("name", sorted(_PUBLIC))
def test_public_snapshots_by_kind_match_a_replay(name):
    snapshot = _public(name)
    found = explain(snapshot)
    peak, by = _replay_by_maker(snapshot)
    kinds = found["kinds"]
    assert found["peak"] == peak + kinds["parameters"] == sum(kinds.values())
    backward_made = kinds["gradients"] + (kinds["temporaries"] if found["phase"] == "backward"
                                          else 0)
    assert backward_made == by["engine"]
    if found["phase"] == "optimizer":       # after backward: every engine block is a gradient
        assert kinds["gradients"] == by["engine"] > 0
        assert kinds["optimizer_state"] + kinds["temporaries"] == by["optim"]
        assert not any("checkpointing" in lever for lever in found["levers"])
    else:
        assert kinds["optimizer_state"] == by["optim"]
    forward_made = kinds["activations"] + (kinds["temporaries"] if found["phase"] == "forward"
                                           else 0)
    assert forward_made == by["python"]
    stripped = copy.deepcopy(snapshot)                    # what stacks="python" would record
    for e in stripped["device_traces"][0]:
        e["frames"] = _python_only(e.get("frames", []))
    assert explain(stripped)["kinds"] == kinds


def test_the_cs336_full_step_peak_holds_the_gradients():
    found = explain(_public("cs336_fullstep"))
    assert found["phase"] == "optimizer"
    assert found["kinds"]["gradients"] > 0.2 * found["peak"]      # 12.72 GiB of 51.16
    assert found["kinds"]["activations"] < 0.01 * found["peak"]   # the logits the loop holds


def test_a_large_file_that_is_no_pickle_is_refused_before_it_is_read(tmp_path):
    """A 3 GB sparse file took 29 s and 3.4 GB of memory to refuse (the review of issue 53):
    its first MiB decides."""
    big = tmp_path / "zeros.pickle"
    with big.open("wb") as f:
        f.truncate(64 * 2**20)
    out = _run(big)
    assert out.returncode == 2 and "does not open as a pickle" in out.stderr, out.stderr
    assert "67,108,864 bytes" in out.stderr

