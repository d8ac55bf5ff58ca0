"""The GPU check's report: one JSON and one Markdown file, rewritten after every stage.

A run stopped by its time limit (or killed) still leaves every stage it finished on disk: each stage is
appended and both files are replaced atomically (write to a temporary name, then rename).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class Report:
    """Stages in run order, each a dict with ``status`` ("ok", "failed", "skipped", "stopped") and its figures."""

    def __init__(self, out: Path, header: dict):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data = {"header": header, "stages": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        self.write()

    def add(self, name: str, result: dict) -> None:
        self.data["stages"][name] = result
        self.write()

    def write(self) -> None:
        _atomic_write(self.out / "gpu_report.json", json.dumps(self.data, indent=1, default=str))
        _atomic_write(self.out / "gpu_report.md", to_markdown(self.data))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _table(rows: list[dict]) -> list[str]:
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys and not isinstance(row[k], dict))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
    return lines


def to_markdown(data: dict) -> str:
    """The report as Markdown: the header, then per stage its status, notes, goals and rows as a table."""
    h = data["header"]
    lines = [f"# GPU check ({'dry run, CPU' if h.get('dry_run') else h.get('device', '?')})", ""]
    lines += [f"- {k}: {_fmt(v)}" for k, v in h.items() if not isinstance(v, dict)]
    if isinstance(h.get("versions"), dict):
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in h["versions"].items()))
    lines.append(f"- started: {data['started']}")
    for name, stage in data["stages"].items():
        lines += ["", f"## {name}: {stage.get('status', '?')} ({stage.get('seconds', 0):.0f} s)", ""]
        lines += [f"- {k}: {_fmt(v)}" for k, v in stage.items() if k not in ("rows", "status", "seconds", "notes")
                  and not isinstance(v, (dict, list))]  # fmt: skip
        for goal in stage.get("goals", []):
            lines.append(f"- goal: {goal}")
        for note in stage.get("notes", []):
            lines.append(f"- note: {note}")
        if stage.get("rows"):
            lines += [""] + _table(stage["rows"])
    return "\n".join(lines) + "\n"
