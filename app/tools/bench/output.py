"""Where a benchmark's report goes: printed, and written to its `--out` file (folders made as needed); the CPU it
names."""

from __future__ import annotations

import contextlib
from pathlib import Path


def publish(report: str, out: str | Path) -> None:
    print(report)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report + "\n")


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it ("unknown" elsewhere)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"
