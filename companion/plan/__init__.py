"""Plan a training run that fits a memory budget: choose the techniques, check it, run it.

Each chapter of the course pulls one lever: micro-batches with accumulation (03), checkpointing
(04), mixed precision (05), ZeRO (07), offload (08), training fewer parameters (LoRA, 09), fewer
bits (8-bit Adam states, QLoRA, 11). Facing
"out of memory", `plan` pulls them together: it predicts every combination's peak and step time,
keeps the fastest that fits, checks it by simulating a training step on fake tensors (nothing
allocated: a 7B model's step is checked on a laptop), and `Plan.run` trains it for real under
`memory_budget`.

One path for every model, and the layout of this folder follows it:
  1. what is known of the model (`known`): formulas for the course's GPT and Llama, which
     published config.json files build (`configs`, `named`); the model's own step traced on fake
     tensors for any other `nn.Module` (`anysim`; `anymodel.plan_model` is `plan` with a step);
  2. the candidates (`space`: the levers, the model's shape; `search`: chapter 09's pruned
     search);
  3. each one's peak by phase and step time by part (`predict`, `parts`, `costmodel`);
  4. what a GPU holds beyond the tensors, line by line, and whether the plan fits the whole
     budget (`budget`);
  5. the fastest simulated until one fits (`simulation`, `training`), in `planner` (`plan`,
     `Plan`), the one report (`report`: the table, the waterfall, why a setup runs out of
     memory; `cli`: `python -m companion plan`);
  6. the plan run for real (`run`, `ranks`: several processes, a torchrun line) and its times
     checked against the predicted ones (`verify`).
Imports run one way: cli -> named -> planner -> known -> predict, budget, simulation -> training
-> space (`anymodel` imports `planner`; ranks names `Plan` for type checkers only).

Example:
    >>> from functools import partial
    >>> p = plan(partial(GPT, 128, 64, 64, 4, 4), 16, budget="6 MiB", device="cpu")
    >>> print(p)                   # candidates (predicted, simulated, time) and the choice
    >>> p.run(10).peak             # measured, under the budget

Memory saved and its cost, per lever: see `predict`'s docstring (what each phase holds) and
`CostModel` (what each costs in time).
Simplified vs real planners: see `planner`.
"""
from companion.plan.anymodel import GENERIC, ModelPlan, plan_model, simulate_model
from companion.plan.known import Formulas, Traced, describe
from companion.plan.budget import Fit
from companion.plan.configs import ModelConfig, load_config
from companion.plan.report import plot_waterfall, waterfall, why_oom
from companion.plan.planner import NothingFits, Plan, Row, plan
from companion.plan.run import RunReport, run_plan, token_batches
from companion.plan.predict import (ADAM8BIT_BYTES, BUCKET_BYTES, DEQUANTIZE_BYTES,
                                    DISK_BANDWIDTH, CostModel,
                                    Prediction, predict_memory, predict_seconds)
from companion.plan.ranks import rank_worker, run_ranks, train_command
from companion.plan.space import (EXACT, FEWER_BITS, LORA_TARGETS, LOSS_CHUNKS, LOW_PRECISION,
                                  PRECISIONS,
                                  TECHNIQUES, Candidate, GPTShape, candidates, capstone_model)
from companion.plan.search import fastest_fitting
from companion.plan.simulation import simulate
from companion.plan.verify import PlanTiming, RankCheck, default_plans, rank_check
from companion.plan.training import (CheckpointedBlocks, Setup, build, micro_step,
                                     optimizer_step, train_step)

__all__ = ["plan", "plan_model", "simulate_model", "ModelPlan", "GENERIC", "run_plan", "token_batches", "Plan", "Row", "RunReport", "NothingFits",
           "Candidate", "GPTShape", "candidates", "capstone_model", "TECHNIQUES",
           "EXACT", "LOW_PRECISION", "FEWER_BITS", "PRECISIONS", "LORA_TARGETS",
           "Prediction", "predict_memory", "CostModel", "predict_seconds",
           "BUCKET_BYTES", "ADAM8BIT_BYTES", "DEQUANTIZE_BYTES", "CheckpointedBlocks",
           "Setup", "build", "micro_step", "optimizer_step", "train_step", "simulate",
           "run_ranks", "rank_worker", "train_command", "Fit", "ModelConfig", "load_config",
           "waterfall", "plot_waterfall", "why_oom", "LOSS_CHUNKS", "DISK_BANDWIDTH",
           "fastest_fitting", "rank_check", "RankCheck", "PlanTiming", "default_plans"]
