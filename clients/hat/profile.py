"""A `tandem profile` (app/tools/profiling/): this machine's measured round-time parts and acceptance, read back.

The profile is one JSON file (schema "tandem-hat-profile", versioned). The device half (HATOptions.profile) starts
its draft-length controller from the profile's draft step, head, link latency and bandwidths and replayed
acceptance instead of its warm-up priors; the worker ([worker] profile) starts its delay predictor g from the
profile's middle-layer times. Both refuse a profile made for another model or split point, and a malformed file
is an error naming the field. Only JSON is read here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.drafting import MeasuredParts

SCHEMA = "tandem-hat-profile"
VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be used: unreadable, malformed (the message names the field), or for another model."""


@dataclass(frozen=True)
class ArcaChoice:
    """The verification shape ARCA picked: a chain verifying `width` positions (width − 1 drafts at most: the draft
    cap; width 1 is U-shape, no drafts), or the token tree of `tree_paths` (its width − 1 rank paths)."""

    width: int
    tree_paths: tuple[tuple[int, ...], ...] | None = None

    @property
    def kind(self) -> str:
        return "chain" if self.tree_paths is None else "tree"

    @property
    def name(self) -> str:
        return f"ARCA: {self.kind} w={self.width}"

    def draft_cap(self, max_draft: int) -> int:
        """The draft cap this shape runs with: a chain's w − 1 (whatever max_draft says); a tree's max_draft, raised
        to its depth when that is deeper (a round drafts the tree only when its cap reaches the depth)."""
        if self.tree_paths is None:
            return self.width - 1
        return max(max_draft, max(len(p) for p in self.tree_paths))


@dataclass(frozen=True)
class HATProfile:
    """The parts of a profile the device half and the worker use at start (the rest is for reports; ARCA's pick is
    `arca_choice`)."""

    path: str
    model: str
    gguf: str
    m: int
    draft_step_ms: dict[int, float]  # device: one draft-model step for r rows (batched)
    head_ms: dict[int, float]  # device: the full LM head over r rows (verification)
    middle_ms: dict[int, dict[int, float]]  # worker: context -> positions -> the middle layers' compute
    rtt_ms: float  # link: round-trip latency beyond transfer and compute
    up_bytes_per_s: float | None  # None: too fast to measure (loopback)
    down_bytes_per_s: float | None
    alpha_chain: float | None
    alpha_eta: float | None
    alpha_confident: float | None
    raw: dict[str, Any]

    def measured_parts(self) -> MeasuredParts:
        """The controller's starting point: a 1-row draft step, the head's cost per row (least squares through the
        origin over the measured row counts, matching the controller's linear head model), the link's latency and
        the replayed acceptance rates."""
        rows = self.head_ms
        head_row = sum(r * t for r, t in rows.items()) / sum(r * r for r in rows) / 1e3
        return MeasuredParts(
            step=self.draft_step_ms[min(self.draft_step_ms)] / 1e3,
            head_row=head_row,
            rtt=self.rtt_ms / 1e3,
            alpha_chain=self.alpha_chain,
            alpha_eta=self.alpha_eta,
            alpha_confident=self.alpha_confident,
        )

    def delay_points(self) -> list[tuple[float, float]]:
        """(positions, seconds) of every measured middle pass: the worker's g starts as their least-squares line."""
        return [(float(w), t / 1e3) for per in self.middle_ms.values() for w, t in per.items()]

    def arca_choice(self) -> ArcaChoice | None:
        """ARCA's pick from the profile's Table I (app/tools/profiling/main.py): the width and shape (chain or token
        tree) with the most modelled tokens per second; a "tree" of fewer than 3 positions is the chain of that
        width. None when the profile has no Table I."""
        table = (self.raw.get("acceptance") or {}).get("table1") or {}
        rows, trees = table.get("rows") or [], table.get("trees") or {}
        best: tuple[float, int, str] | None = None
        for row in rows:
            for shape in ("chain", "tree"):
                rate = float(row[shape]["tokens_per_s"])
                if best is None or rate > best[0] * (1 + 1e-12):
                    best = (rate, int(row["width"]), shape)
        if best is None:
            return None
        _, width, shape = best
        if shape == "chain" or width < 3:
            return ArcaChoice(width=width)
        try:
            paths = tuple(tuple(int(r) for r in path) for path in trees[str(width)])
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{self.path}: acceptance.table1.trees has no valid tree for width {width}") from e
        return ArcaChoice(width=width, tree_paths=paths)

    def check_model(self, names: set[str], m: int) -> None:
        """Refuse a profile made for another model (`names`: the bundle name and/or GGUF file name in use) or m."""
        given = sorted(n for n in names if n)
        if not {self.model, self.gguf} & set(given):
            raise ProfileError(f"profile {self.path} is for model {self.model} ({self.gguf}), not {' / '.join(given)}")
        if self.m != m:
            raise ProfileError(f"profile {self.path} is for m = {self.m}, not m = {m}")


def _field(data: Any, dotted: str, path: str) -> Any:
    cur = data
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise ProfileError(f"profile {path}: missing field '{dotted}'")
        cur = cur[part]
    return cur


def _positive(value: Any, dotted: str, path: str, allow_zero: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = "a number >= 0" if allow_zero else "a positive number"
        raise ProfileError(f"profile {path}: field '{dotted}' must be {need}, got {value!r}")
    return float(value)


def _count_key(key: str, dotted: str, what: str, path: str) -> int:
    """A JSON object key that names a count ("512" -> 512)."""
    try:
        return int(key)
    except ValueError:
        raise ProfileError(f"profile {path}: field '{dotted}' has a {what} {key!r} that is not a count") from None


def _table(value: Any, dotted: str, path: str) -> dict[int, float]:
    """{"1": ms, "2": ms, ...} -> {1: ms, ...}: positive integer keys, positive times, at least one entry."""
    if not isinstance(value, dict) or not value:
        raise ProfileError(f"profile {path}: field '{dotted}' must be a non-empty object of count -> milliseconds")
    out = {}
    for k, v in value.items():
        n = _count_key(k, dotted, "key", path)
        if n < 1:
            raise ProfileError(f"profile {path}: field '{dotted}' has a key {k!r} below 1")
        out[n] = _positive(v, f"{dotted}.{k}", path)
    return dict(sorted(out.items()))


def _rate(value: Any, dotted: str, path: str) -> float | None:
    if value is None:
        return None
    r = _positive(value, dotted, path, allow_zero=True)
    if r > 1:
        raise ProfileError(f"profile {path}: field '{dotted}' must be in [0, 1], got {value!r}")
    return r


def parse_profile(data: Any, path: str = "<profile>") -> HATProfile:
    """Validate a profile's JSON object; ProfileError names the first field that is wrong."""
    if not isinstance(data, dict):
        raise ProfileError(f"profile {path}: not a JSON object")
    if data.get("schema") != SCHEMA:
        raise ProfileError(f"profile {path}: field 'schema' must be {SCHEMA!r}, got {data.get('schema')!r}")
    if data.get("version") != VERSION:
        raise ProfileError(
            f"profile {path}: field 'version' {data.get('version')!r} is not supported (this reads {VERSION})"
        )
    model, gguf, m = (_field(data, k, path) for k in ("model", "gguf", "m"))
    for k, v in (("model", model), ("gguf", gguf)):
        if not isinstance(v, str) or not v:
            raise ProfileError(f"profile {path}: field '{k}' must be a non-empty string")
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ProfileError(f"profile {path}: field 'm' must be an integer >= 1, got {m!r}")
    middle_raw = _field(data, "worker.middle_ms", path)
    if not isinstance(middle_raw, dict) or not middle_raw:
        raise ProfileError(f"profile {path}: field 'worker.middle_ms' must be a non-empty object of context -> table")
    middle = {}
    for ctx, table in middle_raw.items():
        middle[_count_key(ctx, "worker.middle_ms", "context", path)] = _table(table, f"worker.middle_ms.{ctx}", path)
    up, down = (_field(data, f"link.{k}", path) for k in ("up_bytes_per_s", "down_bytes_per_s"))
    alpha = _field(data, "acceptance.alpha", path)
    if not isinstance(alpha, dict):
        raise ProfileError(f"profile {path}: field 'acceptance.alpha' must be an object")
    return HATProfile(
        path=path,
        model=model,
        gguf=gguf,
        m=m,
        draft_step_ms=_table(_field(data, "device.draft_step_ms", path), "device.draft_step_ms", path),
        head_ms=_table(_field(data, "device.head_ms", path), "device.head_ms", path),
        middle_ms=dict(sorted(middle.items())),
        rtt_ms=_positive(_field(data, "link.rtt_ms", path), "link.rtt_ms", path, allow_zero=True),
        up_bytes_per_s=None if up is None else _positive(up, "link.up_bytes_per_s", path),
        down_bytes_per_s=None if down is None else _positive(down, "link.down_bytes_per_s", path),
        alpha_chain=_rate(alpha.get("chain"), "acceptance.alpha.chain", path),
        alpha_eta=_rate(alpha.get("eta"), "acceptance.alpha.eta", path),
        alpha_confident=_rate(alpha.get("confident"), "acceptance.alpha.confident", path),
        raw=data,
    )


def load_profile(path: str | os.PathLike[str]) -> HATProfile:
    """Read and validate a profile file (ProfileError if it cannot be used)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ProfileError(f"profile {p}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"profile {p}: not valid JSON ({e})") from None
    return parse_profile(data, str(p))
