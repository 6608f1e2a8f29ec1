"""The parts of `companion.grading` (use that module; these are its pieces, one per concern).

- `expected`: what a notebook must contain, read from the source notebook; a submission as steps.
- `scan`: what the grader reads in a submission's source (reference uses, lines to review).
- `sandbox`: a learner's interpreter under hard limits, and ending every process it started.
- `child`: the sandbox's side: runs cells, calls answers, replies with plain data.
- `wire`: the messages between them, and reading replies without running code.
- `answer`: `SandboxAnswer`, the learner's answer as a check sees it.
- `session`: the notebook's sandbox, restarted and replayed when lost.
- `withhold`, `cleanroom`: a package copy without an exercise's references; the second, clean run
  of an answer that decides whether it used them.
- `job`: one notebook, in a grading process of its own (started by `boot.BOOT`).
- `batch`: many notebooks, `--jobs` at a time; `integrity`: the grader's own files.
- `reports`: rows, grades.json / grades.csv / grades.sha256, the table.
"""
