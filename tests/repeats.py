"""How often the slow review-answer tests repeat their checks (issue 54: "every hole ... has its
test, run 20 times").

The cheap ones always run 20 times. Five take 1.5-4 minutes at 20 (each call starts gloo workers
or simulates plans): those run `REVIEW_RUNS` times, 3 in the README's test command and
`OOM_REVIEW_RUNS=20 python -m pytest -m slow tests/test_checks_ch0*.py tests/test_checks_ch1*.py`
for the issue's 20 (a check's cases are fresh each call, so more runs are more draws, never the
same one again)."""
import os

REVIEW_RUNS = int(os.environ.get("OOM_REVIEW_RUNS", "3"))
if REVIEW_RUNS < 1:
    raise ValueError(f"OOM_REVIEW_RUNS must be a positive whole number, got {REVIEW_RUNS}")
