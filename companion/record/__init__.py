"""Record the course's experiments on a GPU: `python -m companion record`.

`fit.predicted_peaks` predicts what each chapter holds on the device at given sizes.
"""
from companion.record.fit import gpt_step_bytes, mlp_step_bytes, predicted_peaks

__all__ = ["predicted_peaks", "gpt_step_bytes", "mlp_step_bytes"]
