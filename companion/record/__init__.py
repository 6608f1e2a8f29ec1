"""Record the course's experiments on a GPU, so that learners without one see real GPU figures.

    python -m companion record                    # every chapter, at this GPU's sizes
    python -m companion record --chapters 04 05   # some chapters (merged into the same file)
    python -m companion record --smoke            # every device code path, in about a minute
    python -m companion record --device cpu --out /tmp/results   # CPU sizes: the CI test path

Parts: `runner` (the chapters in order, the results file, `validate` for its schema), the
experiments by concept (`basics`: chapters 00-03; `techniques`: checkpointing, mixed precision,
offload; `parallel`: DataParallel, DDP, ZeRO on real ranks), `fit` (what each chapter holds on
the device, predicted from `companion.estimate`: the check on `companion.device.sizes`), `smoke`
(`smoke.smoke(device)`) and `common`. `companion.results` reads the files back for the notebooks.

Example:
    >>> path, failed = record(["04"], device="cuda")         # course/results/<gpu>.json
"""
from companion.record.fit import gpt_step_bytes, mlp_step_bytes, predicted_peaks
from companion.record.runner import CHAPTERS, record, validate

__all__ = ["CHAPTERS", "record", "validate", "predicted_peaks", "gpt_step_bytes",
           "mlp_step_bytes"]
