"""`python -m companion plan`: will my model fit, and how? For a model of the user's own.

    python -m companion plan --model examples.models:mha_lm --batch 32 --seq-len 64 \\
        --budget 64MiB --device cpu
    python -m companion plan --model mypkg.nets:build --step mypkg.nets:loss_of_batch \\
        --batch 256 --budget 24GiB --device cuda --gpu "RTX 4090" --json

`--model gpt2-xl | llama-3-8b | PATH/config.json` plans a published model on a GPU of the cost
model's table (`--gpu`, `--gpus`, `--seq-len`, `--batch 1M-tokens`, `--host-gib`, `--why-oom`,
`--host-adam-rate`; the output ends with the speeds its step times use and their sources):
see `companion.plan.named`. With `--gpus-per-node 8` a Llama is planned over tensor, pipeline,
context and data parallel GPUs (`--gpus 64 --seq-len 8192 --batch 4M-tokens`; by formula:
`companion.plan.parallel_report`), as it is when no plan of the other path fits. Otherwise `--model` names a function of no arguments that returns
the model (module:function, with the module importable from the current folder, or a
path/to/file.py:function); `--step` one that
takes (model, batch) and returns the loss (default: next-token cross-entropy over `--seq-len`
token ids); `--optimizer` one that takes the parameters (default AdamW). The model is built on
fake tensors: nothing is allocated, so a model larger than this machine is planned here.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import pathlib
import sys

from companion.memory import KINDS, format_bytes, parse_bytes

__all__ = ["add_parser", "load_object"]

_GENERIC_DEFAULT = ["accumulation", "checkpointing"]


def load_object(spec: str):
    """The object named by "package.module:name" or "path/to/file.py:name"."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{spec!r}: write module:function, e.g. mypkg.models:build")
    if module_name.endswith(".py"):
        path = pathlib.Path(module_name)
        if not path.is_file():
            raise ValueError(f"{spec!r}: {path} is a folder, not a .py file" if path.is_dir()
                             else f"{spec!r}: no file {path}")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        _importing(spec, module_name, lambda: loader.loader.exec_module(module))
    else:
        if "" not in sys.path and str(pathlib.Path.cwd()) not in sys.path:
            sys.path.insert(0, str(pathlib.Path.cwd()))   # the user's own modules, from here
        module = _importing(spec, module_name, lambda: importlib.import_module(module_name))
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{spec!r}: {module_name} has no {name!r}") from None


def _importing(spec: str, module_name: str, run):
    """run() (an import of the user's file), its failure one line that names the file: a missing
    package, a syntax error, an exception or sys.exit() at import time."""
    try:
        return run()
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ValueError(f"{spec!r}: cannot import {module_name} ({e}); run from the folder "
                             "that holds it, or give path/to/file.py:function") from None
        raise ValueError(f"{spec!r}: importing {module_name} needs a package that is not "
                         f"installed: {e}" + (" (pip install -e .[hf])" if e.name in
                                              ("transformers", "peft") else "")) from None
    except SyntaxError as e:
        raise ValueError(f"{spec!r}: {module_name} has a syntax error at line {e.lineno}: "
                         f"{e.msg}") from None
    except (Exception, SystemExit) as e:
        raise ValueError(f"{spec!r}: importing {module_name} raised {type(e).__name__}: {e}"
                         ) from None


def _size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a positive size, e.g. 24GiB; got {text!r}")
    return value


def _whole(low: int):
    """An argparse type: a whole number of at least `low`, or a clear message."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"a whole number of at least {low}; got {text!r}")
        return value
    return parse


_positive, _count = _whole(1), _whole(0)


def _names(text: str) -> tuple[str, ...]:
    """An argparse type: comma-separated names ("q_proj,v_proj"), none of them empty."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",")))
    if not all(names) or not all(n.replace("_", "").replace(".", "").isalnum() for n in names):
        raise argparse.ArgumentTypeError(f"Linear names separated by commas, e.g. q_proj,v_proj; "
                                         f"got {text!r}")
    return names


def _cli_names(names) -> list[str]:
    """Techniques as --allow spells them: issue 52's and 59's levers with hyphens
    ("pure-bf16", "fused-loss")."""
    new = ("selective_checkpointing", "pure_bf16", "optimizer_in_backward", "paged_adam8bit",
           "fused_loss", "offload_checkpoints")
    return [n.replace("_", "-") if n in new else n for n in names]


def _gib(text: str) -> float:
    """--host-gib: GiB of host memory, 0 or more and finite (0: nothing may go to the host)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"a number of GiB, 0 or more, e.g. 64; got {text!r}")
    return value


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"a positive number of GB/s, e.g. 60; got {text!r}")
    return value


def _named(spec: str) -> bool:
    """Whether --model names a shipped config or a config.json (not module:function)."""
    return spec.endswith(".json") or ":" not in spec


def _run_parallel(args, *, why: str = "") -> int:
    """The parallel layouts (t, p, c, d) of a Llama: `companion.plan.parallel_report`."""
    from companion.plan.parallel_report import format_parallel, parallel_dict, plan_parallel
    try:
        if args.allow is not None or args.host_gib is not None or args.why_oom:
            raise ValueError("--gpus-per-node plans t, p, c and d by formula; --allow, "
                             "--host-gib and --why-oom belong to the other path (leave out "
                             "--gpus-per-node)")
        report = plan_parallel(args.model, gpu="H100 SXM" if args.gpu is None else args.gpu,
                               gpus=args.gpus, gpus_per_node=args.gpus_per_node,
                               seq_len=args.seq_len,
                               batch="4M-tokens" if args.batch is None else args.batch,
                               budget=args.budget)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"companion plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        data = parallel_dict(report)
        print(json.dumps({**data, "why": why} if why else data, indent=1))
        return 0 if report.plans else 1
    if why:
        print(why)
    print(format_parallel(report))
    return 0 if report.plans else 1


def _run_named(args) -> int:
    if args.gpus_per_node is not None:
        return _run_parallel(args)
    from companion.cost.gpus import SERVER_GPUS
    from companion.plan.named import NOT_KNOWN, format_plans, plan_dict, plan_named
    from companion.plan.planner import NothingFits
    from companion.plan.report import why_oom
    from companion.plan.space import TECHNIQUES, technique_name

    from companion.plan.costmodel import CostModel

    allow = [technique_name(a) for a in args.allow] if args.allow is not None else None
    try:
        if allow is not None and set(allow) - set(TECHNIQUES):
            raise ValueError(f"--allow: choose from {', '.join(_cli_names(TECHNIQUES))}")
        kwargs = {} if allow is None else {"allow": tuple(allow)}
        gpu = "H100 SXM" if args.gpu is None else args.gpu    # None only: "" is an error
        cost = CostModel.for_gpu(gpu, world_size=args.gpus, host_adam_rate=None if
                                 args.host_adam_rate is None else args.host_adam_rate * 1e9)
        result = plan_named(args.model, gpu=gpu, gpus=args.gpus, cost=cost,
                            seq_len=args.seq_len,
                            batch="1M-tokens" if args.batch is None else args.batch,
                            budget=args.budget, verify=args.simulate,
                            host_budget=None if args.host_gib is None      # 0 GiB is no host
                            else int(args.host_gib * 2**30),
                            lora_rank=args.lora_rank, lora_targets=args.lora_targets,
                            **kwargs)
    except NothingFits as e:
        if not _parallel_helps(args):
            print(f"companion plan: {e}", file=sys.stderr)
            return 2
        args.gpus_per_node, args.allow, args.host_gib = min(args.gpus, SERVER_GPUS), None, None
        return _run_parallel(args, why=f"No plan of data parallelism, ZeRO, checkpointing or "
                             f"offload fits ({str(e).splitlines()[0]}); the parallel layouts "
                             f"instead, {args.gpus_per_node} GPUs to a node (--gpus-per-node):")
    except (ValueError, TypeError, RuntimeError, FileNotFoundError) as e:
        print(f"companion plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_dict(result), indent=1))
        return 0
    config = result.config
    print(f"{config.name}: {result.shape.n_params:,} parameters as built ({config.family}); "
          f"{result.batch} sequences of {result.shape.seq_len} tokens per step on "
          f"{result.world_size} x {result.gpu.name} ({format_bytes(result.budget)} each"
          + (f", what CUDA reports of its {format_bytes(result.gpu.memory_bytes)}"
             if result.budget == result.gpu.usable_bytes else "") + ")")
    if args.why_oom:
        print(why_oom(result.plain, result.shown, result.budget, shape=result.shape,
                      cost=result.cost, world_size=result.world_size))
        if any(r.fit.how == "replayed" for r in result.shown):
            print("Each fix's total is its simulated step replayed through the allocator "
                  "(rounding and fragmentation included).")
        print("\n".join(NOT_KNOWN))
    else:
        print(format_plans(result))
    print("Speeds the step times use:")
    print("\n".join(f"  {line}" for line in result.cost.describe()))
    return 0


def _parallel_helps(args) -> bool:
    """Whether the parallel layouts can plan this model: a Llama on more than one GPU."""
    from companion.plan.configs import load_config
    try:
        config = load_config(args.model)
    except ValueError:
        return False
    return (args.gpus > 1 and config.family == "llama" and not config.tied
            and not (config.qkv_bias or config.mlp_bias) and not args.why_oom)


def _run(args) -> int:
    import torch

    if _named(args.model):
        return _run_named(args)
    if args.budget is None and args.gpu is not None:
        from companion.cost import gpus
        try:                                   # the card's usable bytes, what CUDA reports
            args.budget = gpus.gpu(args.gpu).usable_bytes
        except ValueError as e:
            print(f"companion plan: {e}", file=sys.stderr)
            return 2
    if args.batch is None or args.budget is None:
        print("companion plan: a model of yours (module:function) needs --batch and --budget "
              "(or --gpu, whose usable memory is the budget)", file=sys.stderr)
        return 2
    try:
        args.batch = _positive(args.batch)
    except argparse.ArgumentTypeError:
        print(f"companion plan: --batch is a whole number of examples (at least 1) here, got "
              f"{args.batch!r}", file=sys.stderr)
        return 2

    from companion.plan.anymodel import plan_model
    from companion.plan.costmodel import CostModel

    try:
        from companion.plan.anymodel import GENERIC
        if args.allow is None:
            args.allow = list(_GENERIC_DEFAULT)
        if set(args.allow) - set(GENERIC):
            raise ValueError(f"--allow for your own model: choose from {', '.join(GENERIC)}")
        model_fn = load_object(args.model)
        step = load_object(args.step) if args.step else None
        optimizer = load_object(args.optimizer) if args.optimizer else torch.optim.AdamW
        cost = CostModel.for_gpu(args.gpu, world_size=1) if args.gpu is not None else None
        device = args.device or ("cuda" if args.gpu is not None or torch.cuda.is_available()
                                 else "cpu")
        result = plan_model(model_fn, args.batch, budget=args.budget, step=step,
                            seq_len=args.seq_len, vocab=args.vocab, optimizer=optimizer,
                            device=device, allow=args.allow, lora_rank=args.lora_rank,
                            lora_targets=args.lora_targets,
                            cost=cost, gpu=args.gpu, verify=max(args.simulate, 1),
                            fallback=not args.no_fallback)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"companion plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    plain = result.plain
    print(f"model {args.model}: {result.n_params:,} parameters; batch {args.batch}, budget "
          f"{format_bytes(result.budget)} ({format_bytes(result.usable)} usable) on {device}")
    if result.model.note:                          # e.g. it checkpoints its blocks already
        print(f"note: {result.model.note}")
    print(f"the whole batch in one step, no lever: peak {format_bytes(plain.peak)} "
          f"({plain.phase}), by kind at the peak:")
    for kind in KINDS:
        print(f"  {kind.replace('_', ' '):<18}{format_bytes(plain.kinds.get(kind, 0)):>12}")
    print()
    if args.why_oom:
        from companion.plan.report import why_oom
        print(why_oom(plain, result.shown, result.budget, base_seconds=_bf16_seconds(result)))
        if any(r.fit.how == "replayed" for r in result.shown):
            print("Each fix's total is its simulated step replayed through the allocator "
                  "(rounding and fragmentation included).")
    else:
        from companion.plan.named import format_plans
        print(format_plans(result))
    if args.check:
        real = result.check()
        print(f"checked for real on this CPU: the chosen step peaked at {format_bytes(real.peak)} "
              f"({real.peak_phase}) against {format_bytes(result.chosen_row.peak)} simulated "
              f"({(real.peak - result.chosen_row.peak) / result.chosen_row.peak:+.1%})")
    return 0


def _bf16_seconds(result) -> float | None:
    """The predicted step time of the whole batch under bf16 autocast, the step a practitioner
    would run on a GPU (its FLOPs traced like every row's); None on a CPU, where fp32 is the
    usual step."""
    if result.device.type != "cuda":
        return None
    want = dataclasses.replace(result.plain.candidate, precision="autocast")
    found = next((r for r in result.rows if r.candidate == want), None)
    if found is not None:
        return found.seconds["total"]
    return result.model.predict(want, world_size=1, device_type="cuda",
                                cost=result.cost)[1]["total"]


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="will my model fit, and how: plan a training step under a "
                                    "memory budget (any model)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="NAME|CONFIG.json|MODULE:FUNCTION",
                   help="a shipped model (gpt2-xl, llama-3-8b, mistral-7b, qwen2.5-7b), a "
                        "Hugging Face config.json, or a function of no arguments that returns "
                        "the model")
    p.add_argument("--step", metavar="MODULE:FUNCTION",
                   help="step(model, batch) -> loss (default: next-token loss over --seq-len)")
    p.add_argument("--optimizer", metavar="MODULE:FUNCTION",
                   help="optimizer(params) -> torch.optim.Optimizer (default AdamW)")
    p.add_argument("--batch", help="examples per optimizer step; for a named model also "
                                    "tokens, e.g. 1M-tokens (default)")
    p.add_argument("--seq-len", type=_positive, help="tokens per sequence (default step)")
    p.add_argument("--vocab", type=_positive, help="vocabulary (default: the first nn.Embedding's)")
    p.add_argument("--budget", type=_size, help="memory per device, e.g. 24GiB (a named "
                                                 "model: default the GPU's usable memory, "
                                                 "its total as CUDA reports it)")
    p.add_argument("--gpus", type=_positive, default=1, help="GPUs (named models): data parallel, or t·p·c·d with "
                        "--gpus-per-node")
    p.add_argument("--gpus-per-node", type=_positive,
                   help="GPUs a node joins by NVLink: plan a Llama with tensor, pipeline, "
                        "context and data parallelism (t·p·c·d = --gpus) by formula")
    p.add_argument("--host-gib", type=_gib, help="host memory per GPU for offload, GiB")
    p.add_argument("--host-adam-rate", type=_rate, metavar="GB/S",
                   help="bytes the offloaded AdamW streams on your host, GB/s (28 B a "
                        "parameter; default 25, assumed: time yours with companion.cost."
                        "calibrate, whose host AdamW rate x 28 it is)")
    p.add_argument("--why-oom", action="store_true",
                   help="explain why the plain setup does not fit, and the cheapest fixes")
    p.add_argument("--simulate", type=_count, default=4,
                   help="plans simulated on fake tensors before one is chosen (0: none, and "
                        "nothing printed is checked); on CUDA up to 5 more are simulated and "
                        "replayed for the list of plans that fit")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="whose speeds rank the plans and whose lines the budget loses (cuda: "
                        "the context, cuBLAS's workspace)")
    p.add_argument("--gpu", help="a GPU of companion.cost.gpus for the speeds, e.g. 'H100 SXM'")
    p.add_argument("--allow", nargs="+", default=None,
                   help="levers: for your own model accumulation checkpointing autocast lora "
                        "adam8bit (default accumulation checkpointing); for a named model any "
                        "of companion.plan.TECHNIQUES (default the exact ones and bf16), among "
                        "them selective-checkpointing pure-bf16 optimizer-in-backward "
                        "paged-adam8bit fused-loss offload-checkpoints")
    p.add_argument("--lora-rank", type=_positive, default=8)
    p.add_argument("--lora-targets", type=_names, default=(),
                   help="the Linears LoRA and QLoRA adapt, by name, comma-separated (e.g. "
                        "q_proj,v_proj, PEFT's and litgpt's default for a Llama; default: every "
                        "Linear of a block); QLoRA quantizes all of them either way")
    p.add_argument("--json", action="store_true", help="the plan as JSON")
    p.add_argument("--check", action="store_true",
                   help="then run the chosen step for real on this CPU and print its peak")
    p.add_argument("--no-fallback", action="store_true",
                   help="your own model: when an op of the step cannot run on fake tensors, "
                        "stop with an error naming it, instead of measuring the real step on "
                        "this CPU at small micro-batches and scaling it")
    p.set_defaults(run=_run)
