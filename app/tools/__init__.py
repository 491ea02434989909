"""The offline tools: `tandem bench` (bench/), `tandem train-adapter` (training/) and `tandem profile` (profiling/).

They measure, train and profile the product; the product never imports them (only app/cli.py dispatches to them,
lazily).
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the repository: its deploy/ files, and its own text and code
