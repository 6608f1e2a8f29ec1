"""The step-time models of `companion.cost` against real gloo ranks, configuration by configuration.

    python benchmarks/bench_cost.py              # calibrate, then validate every model
    python benchmarks/bench_cost.py --repeat 3   # three validations, to see the run-to-run spread

Calibrates this machine (`cost.calibrate(threads=1)`: one thread, what each rank of `launch.run`
gets), then trains each configuration of `cost.validate.CONFIGS` (single device, DDP at several
caps and k, ZeRO-1/2/3 with k micro-batches) on 1 rank (the single-device and DDP ones) and on 2
ranks, timed in interleaved rounds, and prints predicted against measured step time with the
error per configuration, its parts, and the median and worst error (goal: median <= 10%, none above
30%). Nothing asserts on time: the figures are reported, in benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import statistics

from companion import cost
from companion.cost import validate


def _name(r: dict) -> str:
    extra = f" cap={r['bucket_mb']:g}M" if r["kind"] != "single" and r["kind"] != "zero3" else ""
    return f"{r['kind']:<6} N={r['world_size']} {r['width']}x{r['depth']} b={r['batch']} k={r['k']}{extra}"


def one_run(speeds: cost.Speeds, rounds: int) -> list[dict]:
    local = [c for c in validate.CONFIGS if c["kind"] in ("single", "ddp")]
    rows = validate.validate(local, speeds, world_size=1, rounds=rounds)
    rows += validate.validate(validate.CONFIGS, speeds, world_size=2, rounds=rounds)
    for r in rows:
        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["parts"].items())
        print(f"  {_name(r):<40} measured {r['measured'] * 1e3:7.1f} ms ({r['low'] * 1e3:.1f}-"
              f"{r['high'] * 1e3:.1f}), predicted {r['predicted'] * 1e3:7.1f} ms, error "
              f"{r['error']:+5.0%}   [{parts}]", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="validations to run")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per validation")
    args = parser.parse_args()
    profile = cost.calibrate(threads=1)
    print(f"calibrated in {profile.seconds:.1f} s: fp32 peak {profile.peak_flops() / 1e9:.0f} GFLOP/s, "
          f"copies {profile.copy_bandwidth.median / 1e9:.1f} GB/s, layer "
          f"{profile.layer_seconds.median * 1e6:.0f} us, gloo alpha {profile.alpha.median * 1e6:.0f} us, "
          f"1/beta {1 / profile.beta.median / 1e9:.2f} GB/s")
    speeds = profile.speeds()
    errors: dict[str, list[float]] = {}
    for run in range(args.repeat):
        print(f"validation {run + 1} of {args.repeat}:")
        for r in one_run(speeds, args.rounds):
            errors.setdefault(_name(r), []).append(r["error"])
    flat = [abs(statistics.median(e)) for e in errors.values()]
    by_kind: dict[str, list[float]] = {}
    for name, e in errors.items():
        by_kind.setdefault(name.split()[0] + " " + name.split()[1], []).append(
            abs(statistics.median(e)))
    print(f"median |error| {statistics.median(flat):.0%}, worst {max(flat):.0%}, "
          f"{sum(f <= 0.1 for f in flat)} of {len(flat)} within 10%, "
          f"{sum(f <= 0.3 for f in flat)} within 30%")
    for kind, e in by_kind.items():
        print(f"  {kind:<10} median |error| {statistics.median(e):.0%} over {len(e)}")


if __name__ == "__main__":
    main()
