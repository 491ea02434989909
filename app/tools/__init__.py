"""The offline tools: `tandem bench` (bench/), `tandem train-adapter` (training/) and `tandem profile` (profiling/).

They measure, train and profile the product; the product never imports them (only app/cli.py dispatches to them,
lazily). Their own dependencies are the `tools` extra (matplotlib, tqdm), imported where they are used through
`import_extra`, so every module here imports without them and a run that needs one says what to install.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]  # the repository: its deploy/ files, and its own text and code

INSTALL_EXTRA = "pip install -e '.[tools]'"


def import_extra(name: str) -> ModuleType:
    """A module of the tools extra (matplotlib, tqdm), or SystemExit naming the install that brings it."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        message = f"error: {exc.name} is not installed; the offline tools need their extra: {INSTALL_EXTRA}"
        raise SystemExit(message) from None


def pyplot() -> ModuleType:
    """matplotlib.pyplot, drawing into files only (the Agg backend)."""
    import_extra("matplotlib").use("Agg")
    return import_extra("matplotlib.pyplot")


def pinned_json(path: Path, sha256: str) -> Any:
    """A gzipped JSON file shipped in deploy/ and pinned by its hash (a benchmark's fixed text), or SystemExit when
    it was changed: the published figures were measured on exactly these bytes."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {sha256} (the pinned file was changed)")
    return json.loads(gzip.decompress(data))
