"""companion.compat: the calls newer than torch 2.11 fall back to the older names. Each test hides
the newer call (as torch 2.11 lacks it) and runs the code that uses it."""
import torch
import torch.distributed as dist

from companion import launch
from companion.zero import Comm

NEWER = ("reduce_scatter_single", "all_gather_single")


def _without_the_newer_names(rank, world_size):
    for name in NEWER:                              # torch 2.11 has only the older names
        if hasattr(dist, name):
            delattr(dist, name)
    comm = Comm()
    full = torch.arange(4.0 * world_size) * (rank + 1)
    shard, gathered = torch.empty(4), torch.empty(4 * world_size)
    comm.reduce_scatter(shard, full)
    comm.all_gather(gathered, shard)
    want = full.clone()
    dist.all_reduce(want)
    return torch.equal(gathered, want), [hasattr(dist, n) for n in NEWER], dict(comm.payload)


def test_zero_collectives_run_on_torch_2_11_names():
    for ok, still_there, payload in launch.run(_without_the_newer_names, 2, timeout=30):
        assert ok and still_there == [False, False]
        assert payload == {"reduce_scatter": 4 * 8, "all_gather": 4 * 8}


# The names the package and its tests call that torch 2.11 (what GPU machines often have) lacks:
# found by reading every torch/dist/F/nn attribute the repository uses against torch 2.11.0's
# Python sources and stubs (the wheel's *.py and *.pyi). Both are torch 2.13's names for
# reduce_scatter_tensor / all_gather_into_tensor, which 2.13 deprecates.
NEWER_THAN_2_11 = ("reduce_scatter_single", "all_gather_single")
# Where they may appear: the fallback itself, and the byte counter's table of names it patches
# where they exist (`hasattr`).
ALLOWED = ("companion/compat.py", "companion/zero/comm.py")


def test_the_calls_newer_than_torch_2_11_go_through_compat_only():
    import pathlib
    repo = pathlib.Path(__file__).resolve().parent.parent
    uses = []
    for folder in ("companion", "tests", "benchmarks"):
        for path in (repo / folder).rglob("*.py"):
            name = str(path.relative_to(repo))
            if name in ALLOWED or name == "tests/test_compat.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if any(f".{newer}(" in line for newer in NEWER_THAN_2_11):
                    uses.append(f"{name}:{number}: {line.strip()}")
    assert uses == [], "call companion.compat instead (torch 2.11 lacks these):\n" + "\n".join(uses)
