"""The grader's reports: one row per expected exercise, as JSON and CSV, written atomically, with
their SHA-256 so that a report changed after the grader wrote it can be told apart."""
from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import re
import tempfile
import textwrap

__all__ = ["Row", "escape_csv", "printable", "write_reports", "digest", "format_table"]

# C0 controls and DEL, C1 controls (ECMA-48 section 5; ESC starts the sequences that move the
# cursor, clear the screen or recolour text, and U+009B is a one-character CSI), the bidirectional
# overrides and isolates that reorder what a line shows (Unicode TR9; CVE-2021-42574), and the
# Unicode line and paragraph separators
# C0, DEL, C1, bidirectional overrides and isolates, line and paragraph separators, and the
# invisible ones (zero-width spaces and joiners, marks, word joiner, byte-order mark).
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2060-\u2064"
                       "\u2066-\u2069\u2028\u2029\ufeff]")


@dataclasses.dataclass
class Row:
    notebook: str
    exercise: str
    passed: bool
    points: int
    max_points: int
    message: str
    status: str = ""       # passed, failed, not done, tampered, reference, not graded, ...
    flags: str = ""        # for the instructor: how it ran, what to look at
    chapter: str = ""
    optional: bool = False  # a deep dive's exercise: counted in the total, and shown apart


def escape_csv(value):
    """A CSV cell a spreadsheet will not run as a formula (OWASP: = + - @ tab CR first)."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def printable(text, *, newlines: bool = False) -> str:
    """`text` with every control character shown as an escape (ESC as `\\x1b`), so that text from a
    submission (a file name, an exception's message) cannot move the cursor, clear the screen or
    rewrite lines on a terminal; newlines are kept when `newlines` is true."""
    def shown(match: re.Match) -> str:
        c = match.group()
        if newlines and c == "\n":
            return c
        return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"
    return _CONTROLS.sub(shown, str(text))


def _shown(row: Row) -> Row:
    """The row as reports show it: its texts `printable` (a message keeps its newlines)."""
    return dataclasses.replace(
        row, notebook=printable(row.notebook), exercise=printable(row.exercise),
        message=printable(row.message, newlines=True), status=printable(row.status),
        flags=printable(row.flags), chapter=printable(row.chapter))


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_reports(rows: list[Row],
                  out_dir: str | pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Write grades.json, grades.csv and their SHA-256 (grades.sha256) into out_dir, each file
    replaced atomically; return the JSON and CSV paths."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [dataclasses.asdict(_shown(r)) for r in rows]
    as_json = (json.dumps(records, indent=2, ensure_ascii=False) + "\n").encode()
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=[f.name for f in dataclasses.fields(Row)])
    writer.writeheader()
    writer.writerows({k: escape_csv(v) for k, v in r.items()} for r in records)
    as_csv = text.getvalue().encode()
    json_path, csv_path = out_dir / "grades.json", out_dir / "grades.csv"
    _atomic_write(json_path, as_json)
    _atomic_write(csv_path, as_csv)
    _atomic_write(out_dir / "grades.sha256", digest(as_json, as_csv).encode())
    return json_path, csv_path


def digest(as_json: bytes, as_csv: bytes) -> str:
    """`sha256sum -c` lines for the two reports, as written."""
    return "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n"
                   for name, data in (("grades.json", as_json), ("grades.csv", as_csv)))


def format_table(rows: list[Row], *, columns: int = 100) -> str:
    """A plain-text table: one entry per exercise with its whole message, wrapped to `columns`
    under the message's column (as in the CSV, nothing is cut), and a total per notebook."""
    rows = [_shown(r) for r in rows]
    lines, width = [], max([len(r.exercise) for r in rows] + [8])
    for notebook in dict.fromkeys(r.notebook for r in rows):
        mine = [r for r in rows if r.notebook == notebook]
        chapter = f" ({mine[0].chapter})" if mine[0].chapter else ""
        core = [r for r in mine if not r.optional]
        apart = (f" (core {sum(r.points for r in core)}/{sum(r.max_points for r in core)}, "
                 f"optional deep dives {sum(r.points for r in mine if r.optional)}/"
                 f"{sum(r.max_points for r in mine if r.optional)})"
                 if len(core) < len(mine) else "")
        lines.append(f"{notebook}{chapter}: {sum(r.points for r in mine)}/"
                     f"{sum(r.max_points for r in mine)}{apart}")
        for r in mine:
            mark = "pass" if r.passed else (r.status or "failed").upper()
            head = (f"  {mark:<10}  {r.exercise:<{width}}  {r.points}/{r.max_points}  "
                    + ("(optional) " if r.optional else ""))
            text = [piece for line in (r.message or "").splitlines()
                    for piece in textwrap.wrap(line, max(columns - len(head), 30)) or [""]]
            lines.append(head + (text[0] if text else ""))
            lines += [" " * len(head) + piece for piece in text[1:]]
        if mine[0].flags:
            lines.append(f"  flags: {mine[0].flags}")
    return "\n".join(lines) if lines else "no exercises found"
