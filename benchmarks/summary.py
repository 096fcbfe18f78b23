"""The summary of the issues' ratios (``benchmarks/results/summary.json`` and each run's own):
one value per key, each key naming the run that measured it (``measured_by``), each run its
file, command, machine and date (``runs``).
"""

from __future__ import annotations

import json
from pathlib import Path


def update_summary(path: Path, values: dict, run: str, record: dict,
                   changed: dict | None = None) -> None:
    """``values`` (key -> ratio; None: not measured, left as it was) into the summary at
    ``path``, measured by ``run`` (``record``: its file, command, machine, date). Runs no key
    refers to any more are dropped. ``changed``: what the run measured other than the
    defaults (``--switches``, ``--tiles``), kept in its record."""
    summary = json.loads(path.read_text()) if path.exists() else {}
    by = summary.pop("measured_by", {})
    runs = summary.pop("runs", {})
    for key, value in values.items():
        if value is not None:
            summary[key] = value
            by[key] = run
    runs[run] = {**record, **({"changed_from_defaults": changed} if changed else {})}
    runs = {name: r for name, r in runs.items() if name in by.values()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**summary, "measured_by": by, "runs": runs}, indent=1) + "\n")
