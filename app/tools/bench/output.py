"""Where a benchmark's report goes: printed, and written to its `--out` file (folders made as needed)."""

from __future__ import annotations

from pathlib import Path


def publish(report: str, out: str | Path) -> None:
    print(report)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report + "\n")
