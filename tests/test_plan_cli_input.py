"""`python -m companion plan` on bad input: exit 2 with one line that names what is wrong, never a
traceback and never a silent substitution (issue 53, item 7; the practitioner's trial, F7)."""
import json
import subprocess
import sys

import pytest

from companion.__main__ import main


def _plan(capsys, *args) -> tuple[int, str]:
    """(exit status, stderr) of `python -m companion plan ARGS`, in this process: an exception
    other than argparse's exit fails the test with its traceback."""
    try:
        rc = main(["plan", *args])
    except SystemExit as e:              # argparse's refusal of a flag's value
        rc = e.code
    return rc, capsys.readouterr().err


_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
          "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 100,
          "max_position_embeddings": 32}


@pytest.mark.parametrize("args,says", [
    (["--gpus", "0"], "argument --gpus: a whole number of at least 1; got '0'"),
    (["--gpus", "-2"], "argument --gpus: a whole number of at least 1"),
    (["--seq-len", "0"], "argument --seq-len: a whole number of at least 1; got '0'"),
    (["--lora-rank", "0"], "argument --lora-rank: a whole number of at least 1"),
    (["--simulate", "-1"], "argument --simulate: a whole number of at least 0"),
    (["--host-gib", "-1"], "argument --host-gib: a number of GiB, 0 or more"),
    (["--host-gib", "nan"], "argument --host-gib: a number of GiB, 0 or more"),
    (["--host-gib", "inf"], "argument --host-gib: a number of GiB, 0 or more"),
    (["--budget", "0"], "argument --budget: a positive size"),
    (["--batch", "0"], "--batch must be at least 1 sequence"),
    (["--batch", "1..2M-tokens"], "--batch is a number of sequences (256) or of tokens"),
    (["--gpu", ""], "companion plan: "),
])
def test_bad_numbers_for_a_named_model_are_refused_in_one_line(capsys, args, says):
    rc, err = _plan(capsys, "--model", "llama-3-8b", "--simulate", "0", *args)
    assert rc == 2 and says in err
    assert "Traceback" not in err and says in err.strip().splitlines()[-1]


@pytest.mark.parametrize("config,says", [
    ([1, 2], "a config.json holds one JSON object"),
    ({**_LLAMA, "hidden_size": "256"},
     "'hidden_size' must be a positive whole number, got \"256\" (a string)"),
    ({**_LLAMA, "num_hidden_layers": -2}, "'num_hidden_layers' must be a positive whole number"),
    ({**_LLAMA, "rms_norm_eps": float("inf")}, "'rms_norm_eps' must be a positive finite number"),
    ({**_LLAMA, "tie_word_embeddings": "false"}, "'tie_word_embeddings' must be true or false"),
])
def test_a_bad_config_json_is_refused_naming_the_field(capsys, tmp_path, config, says):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    rc, err = _plan(capsys, "--model", str(path), "--simulate", "0")
    assert rc == 2 and err.startswith(f"companion plan: {path}: ") and says in err
    assert len(err.strip().splitlines()) == 1


def test_own_model_batch_must_be_a_positive_whole_number(capsys):
    for batch in ("0", "-4", "2.5"):
        rc, err = _plan(capsys, "--model", "examples.models:mha_lm", "--batch", batch,
                        "--budget", "64MiB", "--device", "cpu")
        assert rc == 2 and "--batch is a whole number of examples (at least 1)" in err


def test_seq_len_and_host_gib_are_used_as_given(monkeypatch, capsys):
    """The values reach the planner as typed: no `x or default` turns 0 GiB of host memory into
    no limit, and --seq-len is passed as given (the config's longest only when it is left out)."""
    import companion.plan.named as named
    seen = {}

    def fake(model, **kwargs):
        seen.update(kwargs)
        raise ValueError("stop here")
    monkeypatch.setattr(named, "plan_named", fake)
    _plan(capsys, "--model", "llama-3-8b", "--host-gib", "0", "--seq-len", "1024")
    assert seen["host_budget"] == 0 and seen["seq_len"] == 1024 and seen["batch"] == "1M-tokens"
    _plan(capsys, "--model", "llama-3-8b")
    assert seen["host_budget"] is None and seen["seq_len"] is None


def test_the_practitioners_commands_exit_2_without_a_traceback(tmp_path):
    """The trial's four commands (F7), as a user runs them."""
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "strsize.json").write_text(json.dumps({**_LLAMA, "hidden_size": "256"}))
    for args, says in ((["--model", "llama-3-8b", "--gpus", "0"], "--gpus"),
                       (["--model", str(tmp_path / "list.json")], "one JSON object"),
                       (["--model", str(tmp_path / "strsize.json")], "'hidden_size'"),
                       (["--model", "llama-3-8b", "--seq-len", "0"], "--seq-len")):
        run = subprocess.run([sys.executable, "-m", "companion", "plan", *args, "--simulate", "0"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and says in run.stderr and "Traceback" not in run.stderr
        assert run.stdout == ""


def test_the_factory_a_refused_model_type_suggests_plans_that_model(capsys, tmp_path,
                                                                     monkeypatch):
    """Phi-3's model_type is refused; the two lines the message gives, written to factory.py,
    plan the same config.json through transformers (a tiny Phi-3 here)."""
    transformers = pytest.importorskip("transformers")
    config = {"model_type": "phi3", "vocab_size": 128, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "max_position_embeddings": 64,
              "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    rc, err = _plan(capsys, "--model", "config.json", "--simulate", "0")
    assert rc == 2 and "model_type 'phi3' is not supported" in err
    lines = [line.strip() for line in err.splitlines() if line.startswith("    ")]
    assert len(lines) == 2 and lines[0].startswith("from transformers import")
    (tmp_path / "factory.py").write_text("\n".join(lines) + "\n")
    rc = main(["plan", "--model", "factory.py:build", "--batch", "2", "--seq-len", "16",
               "--budget", "1GiB", "--device", "cpu", "--simulate", "1"])
    out = capsys.readouterr().out
    import torch
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(str(tmp_path / "config.json"))).parameters())
    assert rc == 0 and f"model factory.py:build: {n:,} parameters" in out


@pytest.mark.parametrize("source, says", [
    ("import notapackage_xyz\n", "needs a package that is not installed: No module named "
                                 "'notapackage_xyz'"),
    ("def f(:\n    pass\n", "has a syntax error at line 1"),
    ("raise SystemExit('bye')\n", "raised SystemExit: bye"),
    ("raise RuntimeError('no weights server')\n", "raised RuntimeError: no weights server"),
])
def test_a_factory_file_that_cannot_be_imported_is_one_line(tmp_path, capsys, source, says):
    """Its import ran unguarded: a missing package printed Python's traceback (the review of
    issue 53)."""
    factory = tmp_path / "factory.py"
    factory.write_text(source + "\ndef build():\n    return None\n")
    for flag in ("--model", "--step"):
        args = ["--model", f"{factory}:build", "--batch", "2", "--budget", "1GiB"]
        if flag == "--step":
            args = ["--model", "examples.models:mha_lm", "--step", f"{factory}:build",
                    "--batch", "2", "--budget", "1GiB"]
        rc, err = _plan(capsys, *args)
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
