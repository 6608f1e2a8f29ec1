"""The kernel's sandbox (`companion.grader.confine`, bubblewrap): what a determined notebook could
do to the grader, to the clean room and to classmates before it, and cannot now.

Each case is a chapter-01 workbook with one cell added, graded in one batch beside honest
notebooks (`--jobs 3`), as root and in self mode, and the process chain again with `--jobs 1`. Skipped, with the
reason, where bwrap cannot run (the grader then refuses without --trusted, tested below).
"""
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

import grading_notebooks as gn
from grading_notebooks import MSE, REPO, SETUP, body, insert, save, trimmed

needs_bwrap = pytest.mark.skipif(bool(gn.kernel_sandbox_blocked()),
                                 reason=f"no kernel sandbox here: {gn.kernel_sandbox_blocked()}")

MARK = "oom-sandbox-chain-marker"

# 60 processes, each in a session of its own, each starting the next, all sleeping an hour.
CHAIN = r'''import subprocess, sys
LINK = """
import subprocess, sys, time
n = int(sys.argv[1])
if n:
    subprocess.Popen([sys.executable, "-c", sys.argv[2], str(n - 1), sys.argv[2], sys.argv[3]],
                     start_new_session=True)
time.sleep(3600)
"""
subprocess.Popen([sys.executable, "-c", LINK, "60", LINK, "%s"], start_new_session=True)
import time; time.sleep(3)''' % MARK

# Write the reports after the grader exits, and try to stop the grading process now.
REWRITE = r'''import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import pathlib, sys, time; time.sleep(4); "
                  "pathlib.Path(sys.argv[1]).write_text('[]')", "{report}"],
                 start_new_session=True)
for pid in (os.getppid(), 1):
    try:
        os.kill(pid, 9)
    except OSError as e:
        print("kill", pid, e)'''

# Change the installed package and anything else the grader reads; leave a file in /tmp.
WRITES = r'''import pathlib
results = {{}}
for path in ["{package}/checks/core.py", "{out}/grades.json", "/tmp/{mark}-left-behind"]:
    try:
        pathlib.Path(path).write_text("# forged")
        results[path] = "written"
    except OSError as e:
        results[path] = type(e).__name__
print(results)'''

# Fill every place it can write: its own tmpfs and /dev/shm.
FILL = r'''import os
for folder in (os.environ.get("TMPDIR", "/tmp"), "/dev/shm", "/dev"):
    try:
        with open(os.path.join(folder, "fill"), "wb") as f:
            while True:
                f.write(b"x" * 2**20)
    except OSError as e:
        print(folder, type(e).__name__)'''

# The course's own solution read from its source notebook on disk, as the answer's body.
FROM_SOLUTIONS = r'''import json
nb = json.load(open("{source}"))
code = "".join(next("".join(c["source"]) for c in nb["cells"]
                    if c["cell_type"] == "code" and "def mse_gradient" in "".join(c["source"])))
namespace = dict(globals())
exec(code.split("check_mse_gradient(")[0], namespace)
return namespace["mse_gradient"](X, y, w, b)'''

# The reference read from the package's file on disk and run as the answer's own code (its
# names built from pieces, so that only the clean room can tell).
FROM_DISK = '''import pathlib
namespace = {}
source = "\\n" + pathlib.Path("%s", "g" + "d.py").read_text()      # shifted one line
exec(compile(source, "copy.py", "exec"), namespace)
return namespace["mse_" + "gradient"](X, y, w, b)''' % (REPO / "companion")

# A helper process forked from the first run answers with the real reference over an abstract
# unix socket; the answer asks it.
HELPER = r'''import os
from multiprocessing.connection import Listener
if os.fork() == 0:
    os.setsid()
    with Listener("\0oom-sandbox-reference", family="AF_UNIX") as listener:
        while True:
            with listener.accept() as conn:
                import companion.gd
                conn.send(companion.gd.mse_gradient(*conn.recv()))'''
ASK_HELPER = '''from multiprocessing.connection import Client
with Client("\\0oom-sandbox-reference", family="AF_UNIX") as conn:
    conn.send((X, y, w, b))
    return conn.recv()'''


# The red team's channel through the kernel: a process of the first run holds byte-range locks
# on a file every sandbox sees, one lock per byte of the reference's marshalled code; the answer
# reads them back with F_GETLK (it passed 5 of 5 while clean rooms ran beside a paused first run).
LOCKS = r'''import fcntl, marshal, struct, time, operator, multiprocessing as mp
from companion import gd
def _hold(data):
    chan = open("/usr/lib/os-release", "rb")
    for i, v in enumerate(data):
        fcntl.fcntl(chan, fcntl.F_SETLK, struct.pack("hhxxxxqqixxxx", fcntl.F_RDLCK, 0,
                                                     10**9 + i * 512 + v * 2, 1, 0))
    time.sleep(100000)
_p = mp.get_context("fork").Process(target=_hold, args=(marshal.dumps(
    operator.attrgetter("mse_grad" "ient.__co" "de__")(gd)),))
_p.start(); time.sleep(2)'''
ASK_LOCKS = '''import fcntl, marshal, struct, types
chan = open("/usr/lib/os-release", "rb"); data = bytearray()
while True:
    start = 10**9 + len(data) * 512
    t, _, s, _, _ = struct.unpack("hhxxxxqqixxxx", fcntl.fcntl(chan, fcntl.F_GETLK, struct.pack(
        "hhxxxxqqixxxx", fcntl.F_WRLCK, 0, start, 512, 0)))
    if t == fcntl.F_UNLCK:
        break
    data.append((s - start) // 2)
code = marshal.loads(bytes(data)).replace(co_firstlineno=7)
return types.FunctionType(code, {"torch": torch})(X, y, w, b)'''


def _alive(mark: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if mark.encode() in pathlib.Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _grade(folder: pathlib.Path, out: pathlib.Path, run_as: str,
           *extra: str) -> subprocess.CompletedProcess:
    """Grade the folder. Self mode as root is refused (root is beyond any sandbox), so there the
    grader itself runs as nobody, as an unprivileged instructor's would."""
    user, env = {}, dict(os.environ)
    if run_as == "self" and os.geteuid() == 0:
        user = {"user": 65534, "group": 65534, "extra_groups": []}
        env.update(HOME=str(out), TMPDIR="/tmp")
    return subprocess.run([sys.executable, "-m", "companion", "grade", str(folder), "--out",
                           str(out), "--source", str(gn.COURSE), "--exercise-timeout", "20",
                           "--cell-timeout", "60", "--disk", "64MiB", "--run-as", run_as, *extra],
                          cwd=folder, capture_output=True, text=True, timeout=1500, env=env,
                          **user)


def _folder(prefix: str) -> pathlib.Path:
    """A folder every user may use (pytest's own are root's alone)."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    folder.chmod(0o777)
    return folder


def _package_digest() -> str:
    h = hashlib.sha256()
    for p in sorted((REPO / "companion").rglob("*.py")):
        h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module", params=["auto", "self"])
def graded(request, tmp_path_factory):
    """The batch, graded as root (the notebooks as nobody and uids of their own) and with the
    grader's own permissions (`--run-as self`)."""
    if request.param == "auto" and gn.sandbox_blocked():
        pytest.skip(gn.sandbox_blocked())
    folder, out = _folder("sandbox-class-"), _folder("sandbox-grades-")
    request.addfinalizer(lambda: [shutil.rmtree(f, ignore_errors=True) for f in (folder, out)])
    nb = {
        "a_chain": insert(trimmed("01"), SETUP, CHAIN),
        "b_rewrites_reports": insert(trimmed("01"), SETUP, REWRITE.format(report=out / "grades.json")),
        "c_writes": insert(trimmed("01"), SETUP, WRITES.format(
            package=REPO / "companion", out=out, mark=MARK)),
        "d_fills_tmp": insert(trimmed("01"), SETUP, FILL),
        "e_solutions": body(trimmed("01", solved=False), MSE, FROM_SOLUTIONS.format(
            source=gn.source("01"))),
        "f_from_disk": body(trimmed("01"), MSE, FROM_DISK),
        "g_helper": body(insert(trimmed("01"), SETUP, HELPER), MSE, ASK_HELPER),
        "j_locks": body(insert(trimmed("01"), SETUP, LOCKS), MSE, ASK_LOCKS),
        "h_honest": trimmed("01"),
        "i_honest": trimmed("01"),
    }
    for name, notebook in nb.items():
        save(notebook, folder / f"{name}.ipynb").chmod(0o644)
    digest = _package_digest()
    result = _grade(folder, out, request.param, "--jobs", "3")
    ended = time.monotonic()
    assert result.returncode == 0, result.stderr[-3000:]
    time.sleep(max(0.0, 6 - (time.monotonic() - ended)))     # the rewriter's 4 s have passed
    rows = json.loads((out / "grades.json").read_text())
    return {"rows": rows, "out": out, "digest": digest, "stdout": result.stdout}


def _rows(graded, name: str) -> dict[str, dict]:
    return {r["exercise"]: r for r in graded["rows"] if pathlib.Path(r["notebook"]).stem == name}


@pytest.mark.slow
@needs_bwrap
def test_honest_notebooks_keep_full_marks_unflagged_beside_the_attacks(graded):
    for name in ("h_honest", "i_honest"):
        rows = _rows(graded, name)
        assert rows and all(r["points"] == r["max_points"] for r in rows.values()), rows
        flags = next(iter(rows.values()))["flags"]
        assert "bubblewrap" in flags or "ran as " in flags, flags
        assert "review" not in flags and "tampered" not in {r["status"] for r in rows.values()}


@pytest.mark.slow
@needs_bwrap
def test_no_process_of_a_notebook_outlives_the_grader(graded):
    assert _alive(MARK) == []
    assert all(r["points"] == r["max_points"] for r in _rows(graded, "a_chain").values())


@pytest.mark.slow
@needs_bwrap
def test_reports_cannot_be_rewritten_after_the_grader_exits(graded):
    out = graded["out"]
    assert json.loads((out / "grades.json").read_text()) == graded["rows"] != []
    check = subprocess.run(["sha256sum", "-c", "grades.sha256"], cwd=out, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    rows = _rows(graded, "b_rewrites_reports")        # its grading process was out of reach
    assert rows and all(r["status"] == "passed" for r in rows.values()), rows


@pytest.mark.slow
@needs_bwrap
def test_the_grader_s_files_are_read_only_and_tmp_is_private(graded):
    assert _package_digest() == graded["digest"]
    assert not pathlib.Path(f"/tmp/{MARK}-left-behind").exists()
    rows = _rows(graded, "c_writes")
    assert all(r["status"] == "passed" for r in rows.values()), rows


@pytest.mark.slow
@needs_bwrap
def test_a_notebook_that_fills_its_disk_costs_only_itself(graded):
    rows = _rows(graded, "d_fills_tmp")
    assert rows and all(r["status"] == "passed" for r in rows.values()), rows


@pytest.mark.slow
@needs_bwrap
def test_the_source_notebooks_are_absent_from_the_sandbox(graded):
    row = _rows(graded, "e_solutions")["mse_gradient"]
    assert row["points"] == 0 and row["status"] != "passed", row


@pytest.mark.slow
@needs_bwrap
@pytest.mark.parametrize("name", ["f_from_disk", "g_helper", "j_locks"])
def test_the_reference_cannot_reach_the_clean_room(graded, name):
    """Read from the package's file, asked of a process the first run left, or read from the
    locks such a process holds: the answer passes in the notebook and scores 0 on its own, where
    none of them exists (the first run has ended, every process of it with it)."""
    row = _rows(graded, name)["mse_gradient"]
    assert row["points"] == 0 and row["status"] in ("failed", "reference"), row
    assert "on its own" in row["message"] or "withholds" in row["message"], row


@pytest.mark.slow
@needs_bwrap
def test_the_chain_is_ended_with_one_job_too():
    folder, out = _folder("sandbox-class-"), _folder("sandbox-grades-")
    save(insert(trimmed("01"), SETUP, CHAIN), folder / "a_chain.ipynb").chmod(0o644)
    save(trimmed("01", solved=False), folder / "b_fresh.ipynb").chmod(0o644)
    try:
        result = _grade(folder, out, "self", "--jobs", "1")
        rows = json.loads((out / "grades.json").read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _alive(MARK) == []
    assert {r["status"] for r in rows if "b_fresh" in r["notebook"]} == {"not done"}


@pytest.mark.slow
@needs_bwrap
def test_as_root_self_mode_is_refused_unless_trusted(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root is refused self mode")
    nb = save(trimmed("01"), tmp_path / "nb.ipynb")
    refused = subprocess.run([sys.executable, "-m", "companion", "grade", str(nb), "--out",
                              str(tmp_path / "g"), "--run-as", "self"], capture_output=True,
                             text=True, timeout=600)
    assert refused.returncode == 2 and "as root" in refused.stderr, refused.stderr[-2000:]
    assert "--trusted" in refused.stderr and not (tmp_path / "g").exists()


@pytest.mark.slow
def test_without_bwrap_the_grader_refuses_unless_trusted(tmp_path):
    nb = save(trimmed("01"), tmp_path / "nb.ipynb")
    env = dict(os.environ, PATH="/nonexistent")         # no bwrap on the PATH, nor python
    code = ("import sys, companion.grader.confine as c; c.bwrap_path = lambda: None; "
            "import companion.__main__ as m; sys.exit(m.main(sys.argv[1:]))")
    args = [sys.executable, "-c", code, "grade", str(nb), "--out", str(tmp_path / "g"),
            "--exercise-timeout", "20"]
    refused = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert refused.returncode == 2 and "bubblewrap" in refused.stderr, refused.stderr[-2000:]
    assert "--trusted" in refused.stderr and not (tmp_path / "g").exists()

