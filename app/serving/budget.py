"""DiSCo's user-set knobs, as one immutable, validated type: `BudgetSettings`.

The ledger (app/serving/ledger.py) keeps the current value, persists it and books spend; DiSCo's runtime
(app/serving/disco.py) reads it from the ledger and derives its cost models and thresholds from it; GET/PUT
/v1/budget shows and patches it. Prices are kept as providers publish them, USD per million tokens; the cost
model works per token (`Price.token_prices`).

* policy — a dispatch policy name (policies.dispatch.POLICY_NAMES), stored canonical;
* constrained_side — "auto" (Alg. 1 decides from prices), "server" or "device";
* budget b ∈ [0, 1] — share of input tokens the constrained endpoint may process;
* alpha α ∈ (0, 1) — tail ratio. Open interval because that is what policies.dispatch accepts: α = 0 or 1 would
  pass here and then make every recompute raise, turning a bad PUT into broken dispatch;
* exchange_rate λ ∈ [0, 1e7] — USD per 10^15 device FLOPs (see policies.cost.usd_per_pflop);
* consumption_rate r_c ∈ [0.01, 1e4] — client reading speed, tokens/s (Eq. 6's buffer);
* migration — whether DiSCo may migrate generation mid-answer;
* quality_threshold τ ∈ [0, 1] — the `quality` policy's knob: the device's confidence below which its answer goes on on
  the cloud (policies/quality.py);
* prices ∈ [0, 1e4] — per cloud backend, USD per million prompt (prefill) / generated (decode) tokens, and where a
  provider bills them apart, per million prompt tokens read from its prompt cache (cached; absent: the prefill price)
  and reasoning tokens (reasoning; absent: the decode price).

Why upper bounds: a price or rate of 1e308 is finite, yet what it prices overflows (a booking in micro-dollars is
an integer), so such a value is refused here, at PUT and at start-up, naming the field. The bounds sit far above
any real value (the dearest list price is under $1,000 per million tokens; λ = 1e6 is what makes the device
"prohibitively dear" in the tests); what is booked also saturates (app/serving/limits.py's `to_micro`), so nothing
on the token path raises over a cost whatever the settings.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from policies.cost import SIDES, CostModel, DeviceEnergy, Side, TokenPrices, usd_per_pflop
from policies.dispatch import DEFAULT_ALPHA, canonical_name, declaration
from policies.quality import DEFAULT_THRESHOLD, check_threshold

log = logging.getLogger(__name__)

CONSTRAINED_SIDES: tuple[str, ...] = ("auto", *SIDES)
DEFAULT_EXCHANGE_RATE = 0.3  # USD per PFLOP: App. E's server-constrained λ (policies.cost)
# r_c: a typical reader (§2.2: 4-5 tok/s); matches the config's default, a little above
# policies.migration.READING_RATE (4.5), the simulator's default.
DEFAULT_CONSUMPTION_RATE = 4.8
DEFAULT_BUDGET = 0.5
# The ranges a setting may take (the module doc says why there are upper bounds).
MAX_PRICE = 1e4  # USD per 1M tokens
MAX_EXCHANGE_RATE = 1e7  # USD per 1e15 device FLOPs
CONSUMPTION_RATE_RANGE = (0.01, 1e4)  # tokens per second

UNITS = {
    "budget": "share of input tokens the constrained endpoint may process, [0, 1]",
    "alpha": "tail ratio, (0, 1)",
    "exchange_rate": f"USD per 1e15 device FLOPs, [0, {MAX_EXCHANGE_RATE:g}]",
    "consumption_rate": "tokens per second, [{:g}, {:g}]".format(*CONSUMPTION_RATE_RANGE),
    "migration": "whether DiSCo may move generation between endpoints mid-answer",
    "quality_threshold": "the device's mean top-token probability below which the quality policy escalates, [0, 1]",
    "prices": f"USD per 1M tokens, [0, {MAX_PRICE:g}]",
    "cost_usd": "USD",
}


class BudgetValidationError(ValueError):
    """A budget setting is invalid. `field` names it (dotted, e.g. "prices.cloud.decode"),
    or is None when the update as a whole is malformed (not an object)."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def _number(name: str, value: Any) -> float:
    # bool is an int in Python, but `"budget": true` is a client bug, not 1.0.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BudgetValidationError(name, f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise BudgetValidationError(name, f"{name} must be finite, got {value!r}")
    return value


@dataclass(frozen=True)
class Price:
    """A cloud backend's list price, USD per million tokens (as providers publish it, Table 8). `cached` and
    `reasoning`: the prices of the prompt tokens its provider reads from its prompt cache and of reasoning tokens,
    where they differ; None: the prefill (decode) price."""

    prefill: float
    decode: float
    cached: float | None = None
    reasoning: float | None = None

    def token_prices(self) -> TokenPrices:
        """USD per token, the unit policies.cost works in."""
        return TokenPrices.per_million(self.prefill, self.decode, self.cached, self.reasoning)

    def to_dict(self) -> dict[str, float]:
        """The prices set (an unset cached or reasoning price is absent: it follows prefill or decode)."""
        out = {"prefill": self.prefill, "decode": self.decode}
        out.update({k: v for k in _OPTIONAL_PRICE_KEYS if (v := getattr(self, k)) is not None})
        return out


_PRICE_KEYS = ("prefill", "decode")
_OPTIONAL_PRICE_KEYS = ("cached", "reasoning")


def _price(backend: str, value: Any, base: Price | None = None) -> Price:
    """A Price from a Price, a {"prefill", "decode", "cached", "reasoning"} mapping (partial if `base` fills the
    gaps; cached or reasoning null goes back to following prefill or decode) or a (prefill, decode) pair; each
    non-negative."""
    where = f"prices.{backend}"
    if isinstance(value, Price):
        value = value.to_dict()
    elif isinstance(value, tuple | list) and len(value) == 2:
        value = dict(zip(_PRICE_KEYS, value, strict=True))
    if not isinstance(value, Mapping):
        raise BudgetValidationError(where, f"{where} must be an object with 'prefill' and 'decode', got {value!r}")
    for key in value:
        if key not in _PRICE_KEYS + _OPTIONAL_PRICE_KEYS:
            raise BudgetValidationError(
                f"{where}.{key}", f"unknown field {where}.{key}; expected prefill, decode, cached or reasoning"
            )
    out = {}
    for key in _PRICE_KEYS + _OPTIONAL_PRICE_KEYS:
        name = f"{where}.{key}"
        if key in value and (value[key] is not None or key in _PRICE_KEYS):
            out[key] = _number(name, value[key])
            if not 0 <= out[key] <= MAX_PRICE:
                raise BudgetValidationError(
                    name, f"{name} must be ≥ 0 and at most {MAX_PRICE:g} (USD per 1M tokens), got {out[key]!r}"
                )
        elif key in value or (key in _OPTIONAL_PRICE_KEYS and base is None):
            out[key] = None  # an optional price set to null, or not given at all
        elif base is not None:
            out[key] = getattr(base, key)
        else:
            raise BudgetValidationError(name, f"{name} is required")
    return Price(**out)


@dataclass(frozen=True)
class BudgetSettings:
    """DiSCo's user-set knobs. Validated on construction, so an invalid object cannot exist:
    the config's defaults fail fast at start-up with the same messages a bad PUT gets."""

    policy: str = "disco"
    constrained_side: str = "auto"
    budget: float = DEFAULT_BUDGET
    alpha: float = DEFAULT_ALPHA
    exchange_rate: float = DEFAULT_EXCHANGE_RATE
    consumption_rate: float = DEFAULT_CONSUMPTION_RATE
    migration: bool = True
    quality_threshold: float = DEFAULT_THRESHOLD
    prices: Mapping[str, Price] = field(default_factory=dict)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.policy, str):
            raise BudgetValidationError("policy", f"policy must be a string, got {self.policy!r}")
        try:
            set_(self, "policy", canonical_name(self.policy))
        except ValueError as exc:
            raise BudgetValidationError("policy", str(exc)) from None
        if self.constrained_side not in CONSTRAINED_SIDES:
            raise BudgetValidationError(
                "constrained_side",
                f"constrained_side must be one of {', '.join(CONSTRAINED_SIDES)}, got {self.constrained_side!r}",
            )
        budget = _number("budget", self.budget)
        if not 0.0 <= budget <= 1.0:
            raise BudgetValidationError("budget", f"budget must be in [0, 1], got {budget!r}")
        alpha = _number("alpha", self.alpha)
        if not 0.0 < alpha < 1.0:
            raise BudgetValidationError("alpha", f"alpha must be in (0, 1) (exclusive), got {alpha!r}")
        lam = _number("exchange_rate", self.exchange_rate)
        if not 0 <= lam <= MAX_EXCHANGE_RATE:
            raise BudgetValidationError(
                "exchange_rate",
                f"exchange_rate must be ≥ 0 and at most {MAX_EXCHANGE_RATE:g} (USD per PFLOP), got {lam!r}",
            )
        r_c = _number("consumption_rate", self.consumption_rate)
        low, high = CONSUMPTION_RATE_RANGE
        if not low <= r_c <= high:
            raise BudgetValidationError(
                "consumption_rate",
                f"consumption_rate must be > 0 tokens/s, at least {low:g} and at most {high:g}, got {r_c!r}",
            )
        if not isinstance(self.migration, bool):
            raise BudgetValidationError("migration", f"migration must be true or false, got {self.migration!r}")
        try:
            quality = check_threshold(self.quality_threshold)
        except ValueError as exc:
            raise BudgetValidationError("quality_threshold", f"quality_threshold {exc}") from None
        if not isinstance(self.prices, Mapping):
            raise BudgetValidationError("prices", f"prices must be an object keyed by backend, got {self.prices!r}")
        prices = {}
        for name, value in self.prices.items():
            if not isinstance(name, str) or not name:
                raise BudgetValidationError("prices", f"prices keys must be backend names, got {name!r}")
            prices[name] = _price(name, value)
        implied = declaration(self.policy).side
        if implied is not None and self.constrained_side not in ("auto", implied):
            raise BudgetValidationError(
                "constrained_side",
                f"policy {self.policy!r} is {implied}-constrained; constrained_side {self.constrained_side!r} "
                f"contradicts it (use 'auto' or {implied!r}, or policy 'disco')",
            )
        knobs = (("budget", budget), ("alpha", alpha), ("exchange_rate", lam), ("consumption_rate", r_c))
        for name, value in (*knobs, ("quality_threshold", quality)):
            set_(self, name, value)
        set_(self, "prices", MappingProxyType(prices))

    @property
    def lam_usd_per_flop(self) -> float:
        """λ in the unit CostModel takes."""
        return usd_per_pflop(self.exchange_rate)

    def cost_model(self, backend: str, energy: DeviceEnergy) -> CostModel:
        """Eq. 8 for one cloud backend at the current prices and λ: what dispatch, migration and
        booking must all use, so that they agree with what GET /v1/budget shows."""
        try:
            price = self.prices[backend]
        except KeyError:
            known = ", ".join(self.prices) or "none configured"
            raise KeyError(f"no price for cloud backend {backend!r}; known: {known}") from None
        return CostModel(server=price.token_prices(), energy=energy, lam=self.lam_usd_per_flop)

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "constrained_side": self.constrained_side,
            "budget": self.budget,
            "alpha": self.alpha,
            "exchange_rate": self.exchange_rate,
            "consumption_rate": self.consumption_rate,
            "migration": self.migration,
            "quality_threshold": self.quality_threshold,
            "prices": {name: price.to_dict() for name, price in self.prices.items()},
        }


SETTING_FIELDS: tuple[str, ...] = tuple(BudgetSettings.__dataclass_fields__)


def apply_patch(
    base: BudgetSettings, patch: Any, *, unknown_backends: str = "reject", unknown_fields: str = "reject"
) -> BudgetSettings:
    """`base` with the fields of `patch` replaced (prices merged per backend and per field).

    unknown_backends: "reject" (a PUT naming a backend the gateway does not have is a
    typo that would otherwise be silently ignored) or "drop" (a state file written
    when a since-removed cloud was configured).
    unknown_fields: "reject" (a PUT's typo) or "ignore" (settings a newer release wrote to the shared store: the
    fields it added are ignored here, with a warning, and kept there by app/serving/valkey_state.py).
    """
    if not isinstance(patch, Mapping):
        raise BudgetValidationError(None, f"a budget update must be a JSON object, got {type(patch).__name__}")
    unknown = [str(key) for key in patch if key not in SETTING_FIELDS]
    if unknown and unknown_fields == "ignore":
        log.warning("budget settings: ignoring %s, unknown to this release (a newer one's?)", ", ".join(unknown))
    elif unknown:
        key = unknown[0]
        raise BudgetValidationError(key, f"unknown field {key!r}; expected one of {', '.join(SETTING_FIELDS)}")
    fields = {name: getattr(base, name) for name in SETTING_FIELDS}
    fields.update({k: v for k, v in patch.items() if k != "prices" and k in SETTING_FIELDS})
    if "prices" in patch:
        given = patch["prices"]
        if not isinstance(given, Mapping):
            raise BudgetValidationError("prices", f"prices must be an object keyed by backend, got {given!r}")
        prices = dict(base.prices)
        for name, value in given.items():
            if name not in base.prices:
                known = ", ".join(base.prices) or "none configured"
                if unknown_backends == "drop":
                    log.warning("budget state: dropping prices for unknown cloud backend %r (known: %s)", name, known)
                    continue
                raise BudgetValidationError(
                    f"prices.{name}", f"prices for unknown cloud backend {name!r}; known: {known}"
                )
            prices[name] = _price(str(name), value, base=base.prices[name])
        fields["prices"] = prices
    return BudgetSettings(**fields)


def pinned_side(policy: str, constrained_side: str) -> Side | None:
    """The constrained side a request's policy name fixes (the -s / -d variants), else the operator's pin;
    None: Alg. 1 decides from prices."""
    implied = declaration(policy).side
    if implied is not None:
        return implied
    return None if constrained_side == "auto" else constrained_side  # type: ignore[return-value]


def from_config(settings: Any) -> BudgetSettings:
    """The knobs' initial values from app.config.Settings: `gateway.policy`, the `[disco]` table and each cloud's
    `price`. This is where those config fields are validated (the config only types them), so a refused value
    names its config field: `disco.budget: budget must be in [0, 1], got 1.5`."""
    disco = settings.disco
    prices = {
        name: Price(
            cloud.price.prefill_per_million,
            cloud.price.decode_per_million,
            cloud.price.cached_per_million,
            cloud.price.reasoning_per_million,
        )
        for name, cloud in settings.clouds.items()
    }
    try:
        return BudgetSettings(
            policy=settings.gateway.policy,
            constrained_side=disco.side,
            budget=disco.budget,
            alpha=disco.alpha,
            exchange_rate=disco.exchange_rate,
            consumption_rate=disco.consumption_rate,
            migration=disco.migration,
            quality_threshold=disco.quality_threshold,
            prices=prices,
        )
    except BudgetValidationError as exc:
        where = {"policy": "gateway.policy", "constrained_side": "disco.side"}.get(str(exc.field))
        where = where or (f"clouds.{exc.field[7:]}" if str(exc.field).startswith("prices.") else f"disco.{exc.field}")
        raise BudgetValidationError(where, f"{where}: {exc.message}") from None
