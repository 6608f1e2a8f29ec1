"""companion.results: recorded GPU runs read, and shown beside a learner's own figures.

The runs come from small fixture files in tests/fixtures/results (device "cuda" and a CPU test
run that must never be shown as a GPU run), never from course/results."""
import json

import matplotlib
import pytest

from companion import results
from companion.record.runner import validate

matplotlib.use("Agg")

FIXTURES = results.pathlib.Path(__file__).parent / "fixtures" / "results"
GPU = "Fixture GPU (test data, not a measurement)"


def test_fixtures_follow_the_recorders_schema():
    for path in FIXTURES.glob("*.json"):
        validate(json.loads(path.read_text()))


def test_recorded_reads_gpu_runs_only_and_keeps_the_old_keys():
    runs = results.recorded("04", results_dir=FIXTURES)
    assert [r["machine"] for r in runs] == [GPU]                 # the CPU run is left out
    run = runs[0]
    assert (run["device"], run["torch"], run["cuda"], run["date"]) == (
        "cuda", "0.0.0-fixture", "0.0", "2000-01-01")
    assert run["figures"]["measured"]["mlp_step_peak_bytes"] == 3145728
    assert results.recorded("07", results_dir=FIXTURES)[0]["date"] == "2000-01-02"
    assert results.recorded("01", results_dir=FIXTURES) == []


def test_compare_says_plainly_when_no_gpu_run_is_recorded(capsys, tmp_path):
    assert results.compare("04", {"mlp_step_peak_bytes": 1}, results_dir=tmp_path) is None
    out = capsys.readouterr().out
    assert out.strip() == ("No GPU run has been recorded for chapter 04 yet; the numbers above "
                           "are from your device.")
    results.compare("01", results_dir=FIXTURES)                  # a chapter with no GPU run
    assert "No GPU run has been recorded for chapter 01" in capsys.readouterr().out


def test_compare_shows_the_gpu_its_sizes_and_a_table_beside_yours(capsys):
    local = {"mlp_step_peak_bytes": 4 * 2**20, "only_mine": 0.5,
             "mlp_time_ratio": {"x": [1, 2], "y": [1.0, 1.5]}}
    results.compare("04", local, results_dir=FIXTURES, plot=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{GPU} (torch 0.0.0-fixture, CUDA 0.0, recorded 2000-01-01)")
    assert out[1] == "  GPU sizes: width 4096, ckpt_depth 4"
    rows = {line.split("  ")[0]: line.split() for line in out[3:]}
    assert rows["mlp step peak bytes"][-6:] == ["4.00", "MiB", "3.00", "MiB", "2.00", "MiB"]
    assert rows["only mine"][-3:] == ["0.5", "—", "—"]           # no GPU figure: a dash
    assert rows["gpt peak phase"][-3:] == ["—", "backward", "—"]
    assert not any(line.startswith("mlp time ratio") for line in out)   # curves are plotted


def test_plot_curves_puts_the_gpu_curve_on_the_same_axes_as_yours(tmp_path):
    local = {"mlp_time_ratio": {"x": [1, 2, 4, 8], "y": [1.0, 1.2, 1.3, 1.5]}}
    runs = results.recorded("04", results_dir=FIXTURES)
    fig = results.plot_curves(local, runs)
    fig.savefig(tmp_path / "curves.png")
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["mlp: time", "mlp: activations at the peak"]
    lines = {line.get_label(): list(line.get_ydata()) for line in axes[0].get_lines()}
    assert lines == {"yours (measured)": [1.0, 1.2, 1.3, 1.5],
                     f"{GPU} (measured)": [1.0, 1.125, 1.25]}
    saved = {line.get_label(): list(line.get_ydata()) for line in axes[1].get_lines()}
    assert saved[f"{GPU} (predicted)"] == [4.0, 3.0, 4.0]
    assert axes[0].get_xlabel() == "segments s" and axes[1].get_xscale() == "log"
    assert results.plot_curves({}, results.recorded("07", results_dir=FIXTURES)) is None


@pytest.mark.parametrize("name, value, shown", [
    ("peak_bytes", 3 * 2**30, "3.00 GiB"), ("step_seconds", 0.0125, "12.50 ms"),
    ("ratio", 1.23456, "1.235"), ("count", 12345, "12,345"), ("phase", "backward", "backward"),
    ("missing", None, "—"), ("ratio", float("nan"), "nan")])
def test_format_value(name, value, shown):
    assert results.format_value(name, value) == shown


def test_an_unreadable_results_file_says_what_to_do(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json.*python -m companion record"):
        results.recorded("04", results_dir=tmp_path)


def test_curve_makes_plain_json_numbers():
    import torch

    c = results.curve([1, 2], torch.tensor([0.5, 1.5]).unbind(), xlabel="x", ylabel="y",
                      yscale="log")
    assert json.loads(json.dumps(c)) == {"x": [1, 2], "y": [0.5, 1.5], "xlabel": "x",
                                         "ylabel": "y", "yscale": "log"}
    assert results.is_curve(c) and not results.is_curve({"x": [1], "y": [1, 2]})


@pytest.mark.parametrize("name", ["04_gradient_checkpointing", "05_mixed_precision",
                                  "06_data_parallel", "07_zero"])
def test_recorded_sections_compare_their_own_chapter(repo, name):
    """The "Recorded GPU runs" cell of these chapters calls compare() for its own chapter, with
    figures built by names that exist in companion (its imports run)."""
    cells = json.loads((repo / "course" / f"{name}.ipynb").read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"
            and "compare(" in "".join(c["source"])]
    assert len(code) == 1
    assert f'compare("{name[:2]}"' in code[0]
    exec("\n".join(line for line in code[0].splitlines() if line.startswith("from ")), {})
    outputs = [c["outputs"] for c in cells if "compare(" in "".join(c["source"])][0]
    assert outputs and all(o["output_type"] != "error" for o in outputs)
    if not list((repo / "course" / "results").glob("*.json")):     # stored before any GPU run
        assert outputs[0]["text"] == [f"No GPU run has been recorded for chapter {name[:2]} yet; "
                                      "the numbers above are from your device.\n"]
