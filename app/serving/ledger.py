"""DiSCo's budget settings and spend: the one source of truth for cost.

Why one object: the budget a request is dispatched under, the prices its cost is booked at and the spend the
operator sees on GET /v1/budget must never disagree (gateways that track spend in one place and check budgets
in another end up with keys or model names that bypass the budget). So the ledger holds the current
`BudgetSettings` (app/serving/budget.py); DiSCo's runtime reads them from here and is told of every change
(`on_change`: data flows one way, from the ledger to the runtime); the orchestrator books every endpoint's work
through `record`; the HTTP API is a thin view over `snapshot()` and `update()`.

Persistence: settings survive a restart. Each update is written as JSON to a temp file in the state file's
directory, fsync'd and `os.replace`d over the old file, so a crash leaves either the old or the new settings,
never half of each. A file that cannot be read back is an error naming the file: silently falling back to
defaults would quietly lift a budget the operator set. A state file wins over the config at start-up, and says so
(a warning naming every field where it differs, `settings_source` in the snapshot): an operator who edits the
config or sets TANDEM_GATEWAY__POLICY must be told why it has no effect. `reset()` (DELETE /v1/budget, or
`tandem serve --reset-budget` before start) deletes the file and goes back to the config.

Spend is kept in memory only (per-endpoint totals since start, plus a rolling window of the last N requests for
the realised budget ratio). Persisting it would put an fsync on every request; long-run spend belongs in metrics.

Concurrency: every method is synchronous (no awaits) and holds a `threading.Lock` only for plain-Python
bookkeeping, so it is safe from the event loop and from backend threads alike. `update` does its file I/O
outside that lock (serialised by a second lock), so booking a request from another thread never waits for a
disk flush.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.serving.budget import UNITS, BudgetSettings, BudgetValidationError, apply_patch, from_config
from app.serving.limits import MAX_USD, to_micro
from policies.dispatch import POLICY_NAMES

log = logging.getLogger(__name__)

STATE_VERSION = 1
DEFAULT_WINDOW = 1000


@dataclass(frozen=True)
class Booking:
    """What one endpoint did for one request as the ledger booked it (`Ledger.record`): what a shared store is told.
    A running request's later bookings carry what changed since its last (`Tally`): a correction may be negative."""

    request_id: str
    endpoint: str
    new_request: bool  # the request's first booking
    new_for_endpoint: bool  # this endpoint's first booking for the request
    prefill_tokens: int
    decode_tokens: int
    cost_micro: int
    input_tokens: int  # the request's window entry after this booking: l ...
    constrained_input: int  # ... and the constrained endpoint's share of it


@dataclass
class Tally:
    """What the ledger booked so far for one endpoint's work on one request (running totals): booked as it goes, the
    work is booked as deltas against it, so the bookings add up to exactly what one booking at the end would be."""

    prefill_tokens: int = 0
    cached_tokens: int = 0
    decode_tokens: int = 0
    reasoning_tokens: int = 0
    cost_usd: float = 0.0
    cost_micro: int = 0
    booked: bool = False  # booked at least once


class LedgerStateError(RuntimeError):
    """The state file cannot be read, parsed or written; the message names the file."""


@dataclass
class _Totals:
    requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_tokens: int = 0  # of the prefill tokens, read from the provider's prompt cache
    reasoning_tokens: int = 0  # of the decode tokens, reasoning
    cost_usd: float = 0.0
    cost_micro: int = 0  # the same in integer micro-dollars, each booking rounded as a shared store adds it up


@dataclass
class _WindowEntry:
    prompt_tokens: int | None = None  # l, when the caller said; else the largest prefill seen
    max_prefill: int = 0
    constrained_prefill: int = 0
    endpoints: set[str] = field(default_factory=set)

    @property
    def input_tokens(self) -> int:
        return self.prompt_tokens if self.prompt_tokens is not None else self.max_prefill

    @property
    def constrained_input(self) -> int:
        # The constrained endpoint processed "the prompt" once it prefilled it. A race counts
        # the prompt once, not twice; a migration target's prefill of prompt + delivered
        # tokens still counts it once; so each request's share stays in [0, 1].
        return min(self.input_tokens, self.constrained_prefill)


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class Ledger:
    """Budget settings (persisted) and spend (in memory). See the module doc for why.

    state_file: where settings persist (None = in memory only); loaded now if it exists.
    defaults: settings when there is no state file yet; its `prices` keys are the cloud
      backends prices may be set for.
    window: how many recent requests the realised budget ratio is measured over.
    primary_cloud: the cloud backend DiSCo plays against the device unless a request names another.
    """

    def __init__(
        self,
        state_file: str | os.PathLike[str] | None = None,
        defaults: BudgetSettings | None = None,
        *,
        window: int = DEFAULT_WINDOW,
        primary_cloud: str | None = None,
    ):
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.state_file = Path(state_file).expanduser() if state_file not in (None, "") else None
        self.window = window
        self._lock = threading.Lock()  # bookkeeping: settings swap, spend, window
        self._update_lock = threading.Lock()  # serialises update() including its file write
        self._settings = defaults if defaults is not None else BudgetSettings()
        self._defaults = self._settings
        if primary_cloud is None and self._settings.prices:
            primary_cloud = next(iter(self._settings.prices))
        if primary_cloud is not None and primary_cloud not in self._settings.prices:
            raise ValueError(f"primary_cloud {primary_cloud!r} has no price in the defaults")
        self.primary_cloud = primary_cloud
        self._version = 0
        self._listeners: list[Callable[[], None]] = []
        self._bookkeepers: list[Callable[[Booking], None]] = []
        self._totals: dict[str, _Totals] = {}
        self._requests = 0
        self._cost = 0.0
        self._cost_micro = 0
        self._recent: OrderedDict[str, _WindowEntry] = OrderedDict()
        self._win_input = 0
        self._win_constrained = 0
        self.settings_source = "config"
        if self.state_file is not None and self.state_file.exists():
            self._settings = self._load(self.state_file, self._settings)
            self.settings_source = f"state file {self.state_file}"
            _say_what_overrides(self.state_file, self._settings, self._defaults)

    @classmethod
    def from_settings(cls, settings: Any, **kwargs: Any) -> Ledger:
        """The gateway's ledger from app.config.Settings: `gateway.policy`, `[disco]` knobs and each
        cloud's `price` as defaults, persisted at `gateway.state_file` ("" = not persisted).
        A default that BudgetSettings refuses fails start-up naming the config field."""
        defaults = from_config(settings)
        primary = settings.gateway.cloud if settings.gateway.cloud in defaults.prices else None
        return cls(settings.gateway.state_file or None, defaults, primary_cloud=primary, **kwargs)

    # ------------------------------------------------------------------ settings

    @property
    def settings(self) -> BudgetSettings:
        """The current settings (immutable: hold on to it for a whole request)."""
        return self._settings

    @property
    def version(self) -> int:
        """Bumped by every successful update."""
        return self._version

    @property
    def defaults(self) -> BudgetSettings:
        """The config's settings (what DELETE /v1/budget goes back to)."""
        return self._defaults

    def on_booking(self, callback: Callable[[Booking], None]) -> None:
        """Call `callback(booking)` after every booking (a shared store's copy; it must not block)."""
        self._bookkeepers.append(callback)

    def adopt(self, settings: BudgetSettings, version: int, source: str) -> None:
        """Make settings decided elsewhere (a shared store's, at its `version`) current here: persisted like an
        update (the state file is deleted when they are the config's), then the listeners told."""
        with self._update_lock:
            if self.state_file is not None:
                if settings == self._defaults:
                    with contextlib.suppress(OSError):
                        self.state_file.unlink(missing_ok=True)
                else:
                    self._save(self.state_file, settings)
            with self._lock:
                changed = settings != self._settings
                self._settings = settings
                self._version = version
                self.settings_source = source
            if changed:
                log.info("budget settings adopted from %s (version %d): %s", source, version, settings.to_dict())
                self._tell_listeners()

    def on_change(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after every successful update (e.g. to recompute dispatch)."""
        self._listeners.append(callback)

    def update(self, patch: Mapping[str, Any]) -> BudgetSettings:
        """Apply a partial update, persist it, make it current, then tell the listeners.

        Raises BudgetValidationError naming the field (nothing changes), or
        LedgerStateError if the state file cannot be written (nothing changes either:
        memory and disk must not disagree after a restart). A listener that raises
        does not undo the committed update; every listener still runs, and the first
        error is re-raised so the caller can report that applying it failed.

        Run it on the event loop: listeners touch DiSCo state the loop owns, and the
        fsync of a few hundred bytes is a rare admin-path cost.
        """
        with self._update_lock:
            new = apply_patch(self._settings, patch)
            if new == self._settings:
                return new
            if self.state_file is not None:
                self._save(self.state_file, new)
            with self._lock:
                self._settings = new
                self._version += 1
                self.settings_source = (
                    f"state file {self.state_file}" if self.state_file is not None else "PUT /v1/budget (not persisted)"
                )
            log.info("budget settings updated: %s", new.to_dict())
            self._tell_listeners()
            return new

    def reset(self) -> BudgetSettings:
        """Back to the config's settings: the state file is deleted, the listeners told (as after an update)."""
        with self._update_lock:
            if self.state_file is not None:
                try:
                    self.state_file.unlink(missing_ok=True)
                except OSError as exc:
                    raise LedgerStateError(f"cannot delete budget state file {self.state_file}: {exc}") from exc
            with self._lock:
                changed = self._settings != self._defaults
                self._settings = self._defaults
                self.settings_source = "config"
                self._version += changed
            log.info("budget settings reset to the config's: %s", self._defaults.to_dict())
            if changed:
                self._tell_listeners()
            return self._defaults

    def _tell_listeners(self) -> None:
        first_error: Exception | None = None
        for callback in list(self._listeners):
            try:
                callback()
            except Exception as exc:
                log.exception("budget change listener failed")
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    @staticmethod
    def _load(path: Path, defaults: BudgetSettings) -> BudgetSettings:
        try:
            raw = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise LedgerStateError(f"cannot read budget state file {path}: {exc}") from exc
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise LedgerStateError(
                f"budget state file {path} is corrupt (not JSON: {exc}); fix it or delete it to start from the config"
            ) from None
        if not isinstance(data, dict) or data.get("version") != STATE_VERSION or "settings" not in data:
            raise LedgerStateError(
                f"budget state file {path} is not a version-{STATE_VERSION} Tandem budget state "
                '(expected {"version": 1, "settings": {...}}); fix it or delete it'
            )
        try:
            settings = apply_patch(defaults, data["settings"], unknown_backends="drop")
        except BudgetValidationError as exc:
            raise LedgerStateError(f"budget state file {path} is invalid at {exc.field}: {exc.message}") from None
        return settings

    @staticmethod
    def _save(path: Path, settings: BudgetSettings) -> None:
        data = json.dumps({"version": STATE_VERSION, "settings": settings.to_dict()}, indent=2).encode() + b"\n"
        try:
            write_atomic(path, data)
        except OSError as exc:
            raise LedgerStateError(f"cannot write budget state file {path}: {exc}") from exc

    # ------------------------------------------------------------------ spend

    def record(
        self,
        request_id: str,
        endpoint: str,
        prefill_tokens: int,
        decode_tokens: int,
        cost_usd: float,
        *,
        constrained: bool,
        prompt_tokens: int | None = None,
        cached_tokens: int = 0,
        reasoning_tokens: int = 0,
        tally: Tally | None = None,
    ) -> None:
        """Book what one endpoint did for one request; call once per endpoint that ran
        (a cancelled race loser too: its prefill was done and paid for). Calls with the
        same request_id add up while the request is still in the window.

        tally: the work's running totals so far, for work booked as it goes (app/serving/accounting.py): the
          counts and cost given are then the work's totals until now, what is booked is their change since the
          tally (a correction, e.g. a cloud's usage report below our counts, books a negative change), and the
          tally is brought up to date. Nothing changed: nothing booked (after the first booking).

        prefill_tokens: what the endpoint prefilled (prompt, plus the delivered prefix for a
          migration target). cost_usd: its Eq. 8 term. constrained: whether this endpoint
          is the constrained side for this request (the side dispatch used).
        prompt_tokens: the request's prompt length l, the denominator of the budget ratio
          (counted once however many endpoints prefilled it). Without it the largest
          prefill booked for the request stands in, which over-counts a migrated request's
          denominator by its delivered prefix.
        cached_tokens / reasoning_tokens: the parts of prefill_tokens / decode_tokens a provider billed at its
          cached-input / reasoning price (its usage report; cost_usd already prices them).

        A cost past `limits.MAX_USD` (an infinite one too) is booked as that much: nothing on the token path raises
        over a cost (NaN and negative costs are still refused: no caller makes them).
        """
        _count("prefill_tokens", prefill_tokens)
        _count("decode_tokens", decode_tokens)
        if _count("cached_tokens", cached_tokens) > prefill_tokens:
            raise ValueError(f"cached_tokens ({cached_tokens}) are part of prefill_tokens ({prefill_tokens})")
        if _count("reasoning_tokens", reasoning_tokens) > decode_tokens:
            raise ValueError(f"reasoning_tokens ({reasoning_tokens}) are part of decode_tokens ({decode_tokens})")
        if prompt_tokens is not None:
            _count("prompt_tokens", prompt_tokens)
        if isinstance(cost_usd, bool) or not isinstance(cost_usd, int | float) or math.isnan(cost_usd):
            raise ValueError(f"cost_usd must be a number, got {cost_usd!r}")
        if cost_usd < 0:
            raise ValueError(f"cost_usd must be ≥ 0, got {cost_usd!r}")
        if cost_usd > MAX_USD:
            log.warning(
                "request %s: a cost of %r USD booked as %g USD, the most one booking counts",
                request_id,
                cost_usd,
                MAX_USD,
            )
            cost_usd = MAX_USD
        done = tally if tally is not None else Tally()
        cost_micro = to_micro(cost_usd)
        prefill_change = prefill_tokens - done.prefill_tokens
        decode_change = decode_tokens - done.decode_tokens
        cached_change = cached_tokens - done.cached_tokens
        reasoning_change = reasoning_tokens - done.reasoning_tokens
        cost_change, micro_change = float(cost_usd) - done.cost_usd, cost_micro - done.cost_micro
        changes = (prefill_change, decode_change, cached_change, reasoning_change, micro_change)
        if done.booked and not any(changes) and cost_change == 0:
            return
        if tally is not None:
            tally.prefill_tokens, tally.cached_tokens = prefill_tokens, cached_tokens
            tally.decode_tokens, tally.reasoning_tokens = decode_tokens, reasoning_tokens
            tally.cost_usd, tally.cost_micro, tally.booked = float(cost_usd), cost_micro, True
        with self._lock:
            entry = self._recent.get(request_id)
            new_request = entry is None
            if entry is None:
                entry = self._recent[request_id] = _WindowEntry()
                self._requests += 1
                while len(self._recent) > self.window:
                    self._forget(self._recent.popitem(last=False)[1])
            else:
                self._forget(entry)
            if prompt_tokens is not None:
                entry.prompt_tokens = max(entry.prompt_tokens or 0, prompt_tokens)
            entry.max_prefill = max(entry.max_prefill, prefill_tokens)
            if constrained:  # (at least 0: a request that left the window while it ran is back without its share)
                entry.constrained_prefill = max(0, entry.constrained_prefill + prefill_change)
            self._remember(entry)
            totals = self._totals.get(endpoint)
            if totals is None:
                totals = self._totals[endpoint] = _Totals()
            new_for_endpoint = endpoint not in entry.endpoints
            if new_for_endpoint:
                entry.endpoints.add(endpoint)
                totals.requests += 1
            totals.prefill_tokens += prefill_change
            totals.decode_tokens += decode_change
            totals.cached_tokens += cached_change
            totals.reasoning_tokens += reasoning_change
            totals.cost_usd += cost_change
            totals.cost_micro += micro_change
            self._cost += cost_change
            self._cost_micro += micro_change
            booking = Booking(
                request_id,
                endpoint,
                new_request,
                new_for_endpoint,
                prefill_change,
                decode_change,
                micro_change,
                entry.input_tokens,
                entry.constrained_input,
            )
        for callback in self._bookkeepers:
            callback(booking)

    def _forget(self, entry: _WindowEntry) -> None:
        self._win_input -= entry.input_tokens
        self._win_constrained -= entry.constrained_input

    def _remember(self, entry: _WindowEntry) -> None:
        self._win_input += entry.input_tokens
        self._win_constrained += entry.constrained_input

    def realised_budget(self) -> float | None:
        """The realised b over the window: constrained-endpoint input tokens / all input
        tokens; None before any input."""
        with self._lock:
            return self._win_constrained / self._win_input if self._win_input else None

    def realised_ratio(self) -> float:
        """`realised_budget` for a Prometheus gauge, which needs a float: NaN = no data yet."""
        ratio = self.realised_budget()
        return math.nan if ratio is None else ratio

    # ------------------------------------------------------------------ view

    def snapshot(self) -> dict[str, Any]:
        """Settings and live spend as plain JSON-able data, for GET /v1/budget."""
        settings = self._settings
        with self._lock:
            spend = {
                "requests": self._requests,
                "cost_usd": self._cost,
                "cost_micro": self._cost_micro,
                "endpoints": {
                    name: {
                        "requests": t.requests,
                        "prefill_tokens": t.prefill_tokens,
                        "decode_tokens": t.decode_tokens,
                        "cached_tokens": t.cached_tokens,
                        "reasoning_tokens": t.reasoning_tokens,
                        "cost_usd": t.cost_usd,
                        "cost_micro": t.cost_micro,
                    }
                    for name, t in self._totals.items()
                },
                "window": {
                    "size": self.window,
                    "requests": len(self._recent),
                    "input_tokens": self._win_input,
                    "constrained_input_tokens": self._win_constrained,
                    "realised_budget": self._win_constrained / self._win_input if self._win_input else None,
                },
            }
            version = self._version
        return {
            **settings.to_dict(),
            "settings_source": self.settings_source,
            "primary_cloud": self.primary_cloud,
            "known_policies": list(POLICY_NAMES),
            "units": dict(UNITS),
            "version": version,
            "spend": spend,
        }


def write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash at any point leaves the old or the new file.

    The temp file lives in the same directory (os.replace is atomic only within one
    file system) and is fsync'd before the rename (else the rename can reach the disk
    before the data); the directory is fsync'd after it so the rename itself survives.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # not every platform/file system can fsync a directory
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _say_what_overrides(path: Path, loaded: BudgetSettings, config: BudgetSettings) -> None:
    """Start-up's word on which source won: every field where the state file overrides the config."""
    ours, theirs = loaded.to_dict(), config.to_dict()
    differ = [f"{k} = {ours[k]!r} (config: {theirs[k]!r})" for k in ours if ours[k] != theirs.get(k)]
    if not differ:
        log.info("budget settings: the state file %s matches the config", path)
        return
    log.warning(
        "budget settings from %s, set over PUT /v1/budget, override the config: %s. "
        "DELETE /v1/budget or `tandem serve --reset-budget` goes back to the config.",
        path,
        "; ".join(differ),
    )
