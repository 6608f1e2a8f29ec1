"""Run the chapters' experiments on one machine and write `<out>/<machine>.json`.

`record(["04", "05"], device="cuda")` runs each chapter's experiment (`CHAPTERS`) at the device's
sizes (`companion.device.sizes`), one after another under a progress bar, and merges the results
into the machine's file (the schema is in `companion.results`): a chapter recorded again replaces
its old record, the others stay. The file is written after every chapter, so a run that stops
keeps what it measured. A chapter that fails is reported at the end and not written.

Example:
    >>> path, failed = record(["01"], device="cpu", out="/tmp/results")
    >>> json.loads(path.read_text())["chapters"]["01"]["measured"]

Simplified vs a benchmark harness: one process, chapters in order, no retries; the multi-process
chapters start their own ranks (`companion.launch`).
"""
from __future__ import annotations

import datetime
import gc
import json
import pathlib
import platform
import re
import time
import traceback
from typing import Callable

import torch

from companion.device import describe, gpu_class, sizes
from companion.record import (attention, basics, capstone, lowbit, parallel, parallelisms, remat,
                              techniques)
from companion.record.common import SizesRead
from companion.results import RESULTS_DIR, is_curve

__all__ = ["CHAPTERS", "record", "machine", "file_name", "validate"]

CHAPTERS: dict[str, Callable] = {
    "00": basics.anatomy, "01": basics.batch_activations, "02": basics.low_precision_sums,
    "03": basics.batch_memory, "04": techniques.checkpoint_segments,
    "05": techniques.mixed_precision, "06": parallel.data_parallel, "07": parallel.zero,
    "08": techniques.offload, "09": capstone.capstone, "10": attention.attention_sweep,
    "11": lowbit.fewer_bits, "12": remat.activations_budget, "13": parallelisms.parallelisms,
}


def machine(device: torch.device) -> dict:
    """The header of a results file: which machine, which software."""
    info = describe(device)
    head = {"machine": info["name"], "device": device.type, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version()}
    if device.type == "cuda":
        head.update(gpus=torch.cuda.device_count(), memory_bytes=info["memory_bytes"],
                    size_class_gb=gpu_class(info["memory_bytes"]))
    else:
        head.update(machine=f"CPU {info['name']}", threads=info["threads"])
    return head


def file_name(head: dict) -> str:
    """'nvidia-h200.json', '2x-nvidia-a100-sxm4-80gb.json', 'cpu-x86_64.json'."""
    count = head.get("gpus", 1)
    name = (f"{count}x " if count > 1 else "") + head["machine"]
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + ".json"


def validate(record: dict) -> None:
    """Raise ValueError naming what is wrong when `record` does not follow the results schema."""
    for key in ("machine", "device", "torch", "cuda", "date", "chapters"):
        if key not in record:
            raise ValueError(f"a results file needs {key!r}")
    for chapter, rec in record["chapters"].items():
        if not re.fullmatch(r"\d\d", chapter):
            raise ValueError(f"chapter {chapter!r}: chapters are two digits, like '04'")
        for key in ("experiment", "date", "seconds", "sizes", "measured", "predicted"):
            if key not in rec:
                raise ValueError(f"chapter {chapter} needs {key!r}")
        if not all(isinstance(v, int) for v in rec["sizes"].values()):
            raise ValueError(f"chapter {chapter}: sizes are whole numbers")
        for part in ("measured", "predicted"):
            for name, value in rec[part].items():
                ok = is_curve(value) or isinstance(value, (int, float, str)) or value is None
                curve_ok = not isinstance(value, dict) or is_curve(value) and all(
                    isinstance(v, (int, float)) for v in value["x"] + value["y"])
                if not (ok and curve_ok):
                    raise ValueError(f"chapter {chapter}, {part} {name!r}: a value is a number, "
                                     f"a string or a curve {{'x': [...], 'y': [...]}}, got "
                                     f"{value!r:.80}")


def record(chapters: list[str] | None = None, *, device: torch.device | str,
           out: pathlib.Path | str | None = None, base_sizes=None, repeats: int = 3,
           progress: bool = True) -> tuple[pathlib.Path, dict[str, str]]:
    """Run `chapters` (all by default) on `device` and merge them into `<out>/<machine>.json`.

    `base_sizes` replaces the device's sizes (the smoke run's small ones); `repeats` is how many
    timed runs each median takes (default 3). Returns the file's path and
    {chapter: error} for the chapters that failed."""
    from tqdm.auto import tqdm

    device = torch.device(device)
    chapters = list(CHAPTERS) if chapters is None else chapters
    unknown = [c for c in chapters if c not in CHAPTERS]
    if unknown:
        raise ValueError(f"no recorded experiment for chapter(s) {', '.join(unknown)}; "
                         f"choose from {', '.join(CHAPTERS)}")
    head = machine(device)
    path = pathlib.Path(out if out is not None else RESULTS_DIR) / file_name(head)
    saved = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    result = head | {"chapters": saved.get("chapters", {})}
    failed = {}
    bar = tqdm(chapters, desc=f"recording on {head['machine']}", disable=not progress)
    for chapter in bar:
        bar.set_postfix_str(f"chapter {chapter}")
        S = SizesRead(base_sizes or sizes(device))
        start = time.perf_counter()  # host clock
        try:
            run = CHAPTERS[chapter](S, device, repeats=repeats)
        except Exception as e:                  # one chapter's failure must not lose the others
            failed[chapter] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            continue
        finally:
            _release(device)
        today = datetime.date.today().isoformat()
        result["chapters"][chapter] = {"experiment": run["experiment"], "date": today,
                                       "seconds": round(time.perf_counter() - start,  # host clock
                                                        2),
                                       "sizes": dict(S.read), "measured": run["measured"],
                                       "predicted": run["predicted"]}
        result["date"] = today
        _write(path, result)
    return path, failed


def _release(device: torch.device) -> None:
    gc.collect()                                  # models of the last chapter, and their cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _write(path: pathlib.Path, result: dict) -> None:
    result["chapters"] = dict(sorted(result["chapters"].items()))
    validate(result)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)                             # never a half-written file
