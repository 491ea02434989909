"""Where a benchmark's report goes: printed, and written to its `--out` file (folders made as needed), or its raw
results as JSON; the CPU it names."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any


def publish(report: str, out: str | Path) -> None:
    print(report)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report + "\n")


def write_json(results: dict[str, Any], out: str | Path | None) -> None:
    """A benchmark's raw results as JSON at `out` (folders made as needed); nothing when no `--out` was given."""
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("unknown" elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"
