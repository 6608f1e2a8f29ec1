"""Time beside bytes: what a training step costs in seconds, measured and modelled.

The course counts bytes exactly; a practitioner choosing between DDP, ZeRO-1/2/3, accumulation and
offload also needs to know how much slower each is. This package is the one home for time:

- `clock`: the package's one timer of device work (a host-device sync on both ends);
- `stats`: medians of interleaved repeats, a bootstrap interval of a ratio, a rank test, and
  the verdict "faster", "slower" or "no difference detected" (`compare`);
- `network`: the α–β model of communication (ring all-reduce, reduce-scatter, all-gather, the
  overlap of buckets with backward) and its fit to timed collectives;
- `gpus`: a table of GPUs (memory, FLOP/s by dtype, bandwidths, SRAM), every number cited, with
  the fraction of peak real kernels reach (`efficiency`);
- `profile`: `calibrate()`, the learner's machine measured in under 20 seconds;
- `speeds`: what a rank does per second (`Speeds`) and what a model asks of it (`Layer`);
- `step`: step-time models for one device, DDP, ZeRO-1/2/3 with accumulation and prefetch, and
  offload, each returning its parts (`StepTime`);
- `validate`: those models against real gloo ranks (`benchmarks/bench_cost.py` reports them).

Example:
    >>> from companion import cost
    >>> speeds = cost.calibrate(threads=1).speeds()                    # doctest: +SKIP
    >>> cost.ddp_step(cost.mlp_layers(512, 32, 16), speeds, 2, bucket_bytes=4 * 2**20).parts()
"""
from companion.cost import gpus, network, stats
from companion.cost.profile import DeviceProfile, Measured, calibrate
from companion.cost.stats import compare
from companion.cost.speeds import Layer, Speeds, gpt_layers, mlp_layers, training_flops
from companion.cost.step import (OFFLOAD_RUNGS, StepTime, ddp_step, offload_break_even,
                                 offload_ladder, offload_step, offload_traffic, single_step,
                                 tokens_to_hide_gathers, zero_step, zero_traffic)

__all__ = ["gpus", "network", "stats", "calibrate", "DeviceProfile", "Measured", "compare", "Layer",
           "Speeds", "StepTime", "ddp_step", "gpt_layers", "mlp_layers", "offload_step",
           "OFFLOAD_RUNGS", "offload_traffic", "offload_ladder", "offload_break_even",
           "single_step", "tokens_to_hide_gathers", "training_flops", "zero_step",
           "zero_traffic"]
