"""`python -m companion plan`: will my model fit, and how? For a model of the user's own.

    python -m companion plan --model examples.models:mha_lm --batch 32 --seq-len 64 \\
        --budget 64MiB --device cpu
    python -m companion plan --model mypkg.nets:build --step mypkg.nets:loss_of_batch \\
        --batch 256 --budget 24GiB --device cuda --gpu "RTX 4090" --json

`--model` names a function of no arguments that returns the model (module:function, with the
module importable from the current folder, or a path/to/file.py:function); `--step` one that
takes (model, batch) and returns the loss (default: next-token cross-entropy over `--seq-len`
token ids); `--optimizer` one that takes the parameters (default AdamW). The model is built on
fake tensors: nothing is allocated, so a model larger than this machine is planned here.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pathlib
import sys

from companion.memory import KINDS, format_bytes, parse_bytes

__all__ = ["add_parser", "load_object"]


def load_object(spec: str):
    """The object named by "package.module:name" or "path/to/file.py:name"."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{spec!r}: write module:function, e.g. mypkg.models:build")
    if module_name.endswith(".py"):
        path = pathlib.Path(module_name)
        if not path.is_file():
            raise ValueError(f"{spec!r}: no file {path}")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        if "" not in sys.path and str(pathlib.Path.cwd()) not in sys.path:
            sys.path.insert(0, str(pathlib.Path.cwd()))   # the user's own modules, from here
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"{spec!r}: cannot import {module_name} ({e}); run from the folder "
                             "that holds it, or give path/to/file.py:function") from e
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{spec!r}: {module_name} has no {name!r}") from None


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _run(args) -> int:
    import torch

    from companion.plan.anymodel import plan_model
    from companion.plan.costmodel import CostModel

    try:
        model_fn = load_object(args.model)
        step = load_object(args.step) if args.step else None
        optimizer = load_object(args.optimizer) if args.optimizer else torch.optim.AdamW
        cost = CostModel.for_gpu(args.gpu) if args.gpu else None
        device = args.device or ("cuda" if args.gpu or torch.cuda.is_available() else "cpu")
        result = plan_model(model_fn, args.batch, budget=args.budget, step=step,
                            seq_len=args.seq_len, vocab=args.vocab, optimizer=optimizer,
                            device=device, allow=args.allow, lora_rank=args.lora_rank,
                            cost=cost)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"companion plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    plain = result.plain
    print(f"model {args.model}: {result.n_params:,} parameters; batch {args.batch}, budget "
          f"{format_bytes(result.budget)} ({format_bytes(result.usable)} usable) on {device}")
    print(f"the whole batch in one step, no lever: peak {format_bytes(plain.peak)} "
          f"({plain.phase}), by kind at the peak:")
    for kind in KINDS:
        print(f"  {kind.replace('_', ' '):<18}{format_bytes(plain.kinds.get(kind, 0)):>12}")
    print()
    print(result)
    if args.check:
        real = result.check()
        print(f"checked for real on this CPU: the chosen step peaked at {format_bytes(real.peak)} "
              f"({real.peak_phase}) against {format_bytes(result.chosen_row.peak)} simulated "
              f"({(real.peak - result.chosen_row.peak) / result.chosen_row.peak:+.1%})")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="will my model fit, and how: plan a training step under a "
                                    "memory budget (any model)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="MODULE:FUNCTION",
                   help="a function of no arguments that returns the model")
    p.add_argument("--step", metavar="MODULE:FUNCTION",
                   help="step(model, batch) -> loss (default: next-token loss over --seq-len)")
    p.add_argument("--optimizer", metavar="MODULE:FUNCTION",
                   help="optimizer(params) -> torch.optim.Optimizer (default AdamW)")
    p.add_argument("--batch", required=True, type=int, help="examples per optimizer step")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default step)")
    p.add_argument("--vocab", type=int, help="vocabulary (default: the first nn.Embedding's)")
    p.add_argument("--budget", required=True, type=_size, help="memory per device, e.g. 24GiB")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="whose speeds rank the plans and the margin kept (10%% on cuda)")
    p.add_argument("--gpu", help="a GPU of companion.cost.gpus for the speeds, e.g. 'H100 SXM'")
    p.add_argument("--allow", nargs="+", default=["accumulation", "checkpointing"],
                   choices=("accumulation", "checkpointing", "autocast", "lora", "adam8bit"),
                   help="levers (default accumulation checkpointing)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.add_argument("--check", action="store_true",
                   help="then run the chosen step for real on this CPU and print its peak")
    p.set_defaults(run=_run)
