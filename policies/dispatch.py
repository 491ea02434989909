"""DiSCo dispatch (§4.2, Alg. 1-3) and the paper's baselines → a `DispatchPlan` per request.

Why two steps: the optimisation over p(l) and F is done in `recompute` — when the
estimators have moved or the budget changed — and leaves a few thresholds, so the
per-request `decide(length, u)` is a handful of comparisons (the paper measures
9-15 ms per recompute for 100K samples; a request must not pay that).

Budget b ∈ [0, 1] is the share of prompt (input) tokens the *constrained*
endpoint may process: the server's share for DiSCo-S / Stoch-S, the device's for
DiSCo-D / Stoch-D. A prompt counts against the budget as soon as the constrained
endpoint starts on it (a cancelled race loser has done, and is billed for, its
prefill).

Policies:

* ``disco-s`` (server-constrained, Eq. 3 / Alg. 3): prompts shorter than l_th run
  on the device only; longer prompts race both endpoints, first token wins.
  l_th solves Σ_{l<l_th} l·p(l) = (1 − b)·E[l]. p(l) is discrete, so the length
  *at* the threshold is split at random (`tie_fraction` of its prompts go to the
  device) to spend exactly b in expectation instead of over- or undershooting by a
  whole atom; for a continuous p(l) this is Eq. 3 exactly.
* ``disco-d`` (device-constrained, Eqs. 1-2 / Alg. 2): always start the cloud;
  start the device after w(l) unless the cloud's first token came first.
  w_tail = F^{-1}(1 − min(α, b)) protects the tail. If b > α, the remaining budget
  buys w(l) = 0 for the shortest lengths (each costs p(l)·l·(1 − α)/E[l]); at the
  first length that does not fit, w* ∈ [0, w_tail] is solved so that the
  expected device use meets the budget exactly; longer lengths keep w_tail.
  (Alg. 2's line 18 is garbled in print; we solve p(l)·l·(P(T > w*) − α)/E[l] =
  remaining budget, which is what the text describes. α enters as realised on the
  empirical CDF — P(T > w_tail) — which equals α up to 1/N.)
* ``disco``: DiSCo-S or DiSCo-D by the constrained side (Alg. 1, `policies.cost`).
* ``server-only`` (the paper's "vLLM" baseline) / ``device-only`` ("llama.cpp");
  aliases ``cloud`` / ``device``.
* ``stoch-s``: a random share b of requests goes to the server, the rest to the
  device. ``stoch-d``: a random share b goes to the device, the rest to the
  server. (§5.1 "randomly routes requests"; `race=True` makes the chosen share
  race both endpoints instead, an ablation that isolates length-awareness.)

* ``quality``: DiSCo's start, and the answer escalated onto the cloud mid-way when the
  device falters (policies/quality.py).

Each policy is declared once (`PolicyDeclaration`, `DECLARATIONS`): its names, the side
it constrains, whether it migrates for cost or quality. The gateway looks it up there.

A cloud co-located with the device (it computes on the device's own hardware, as the
embedded stand-in does) makes every plan that runs both endpoints at once a loss: the
two share the cores, so each one's first token comes later than it would alone, and a
race's winner is never sooner than the faster endpoint alone (`unshared`).

Caches: an endpoint that holds a prompt's start prefills only the rest. A policy decides on the *device's* length,
the tokens it would evaluate (a 15,000-token prompt of which it holds 14,800 is a 200-token prompt to it); each
endpoint's expected TTFT and prefill cost count what it holds (`Outlook`, filled by the gateway's runtime). A device
start that cannot win (`beyond_reach`) is dropped: on a long prompt it would prefill for minutes, for nothing.

Randomness comes from the caller's uniform draw `u` or an injected
`random.Random`; nothing here reads a clock.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from policies.cost import SIDES, Side
from policies.estimate import inverse_cdf

if TYPE_CHECKING:
    from policies.estimate import Estimators

DEFAULT_ALPHA = 0.05  # tail ratio α: reserve budget for the worst 5% of server TTFTs (covers the P99)
BEYOND_REACH_SECONDS = 5.0  # a device start that cannot win is dropped only when it would hold the device this long


@dataclass(frozen=True)
class Outlook:
    """What a plan saw of each endpoint for one prompt: the leading tokens each holds in a cache, its expected time to
    first token (seconds; None where it cannot be said: a cloud not yet measured) and what its prefill is expected to
    cost (Eq. 8's term: the device's energy for the tokens it evaluates, the cloud's input price and its cached price
    for the share its provider is expected to read from its cache)."""

    prompt_tokens: int
    device_cached: int = 0
    cloud_cached: float = 0.0
    device_ttft: float | None = None
    cloud_ttft: float | None = None
    device_prefill_cost: float = 0.0
    cloud_prefill_cost: float = 0.0

    @property
    def device_tokens(self) -> int:
        """The tokens the device would evaluate: what a policy decides on."""
        return max(0, self.prompt_tokens - self.device_cached)

    def describe(self) -> dict[str, float | int | None]:
        return {
            "device_cached_tokens": self.device_cached,
            "cloud_cached_tokens": round(self.cloud_cached),
            "device_ttft_s": None if self.device_ttft is None else round(self.device_ttft, 4),
            "cloud_ttft_s": None if self.cloud_ttft is None else round(self.cloud_ttft, 4),
            "device_prefill_usd": self.device_prefill_cost,
            "cloud_prefill_usd": self.cloud_prefill_cost,
        }


@dataclass(frozen=True)
class DispatchPlan:
    """Where one request starts.

    start_cloud / start_device: which endpoints will run. device_delay only matters
    when both do: 0.0 = race now; w > 0 = start the device w seconds after the
    cloud unless the cloud's first token arrived first (DiSCo-D); None when only
    one endpoint runs. Whichever endpoint produces the first token wins; the other
    is cancelled.
    """

    start_cloud: bool
    start_device: bool
    device_delay: float | None
    policy: str
    reason: str
    outlook: Outlook | None = None  # what the plan saw of each endpoint (the gateway's runtime fills it)

    def __post_init__(self) -> None:
        if not (self.start_cloud or self.start_device):
            raise ValueError("a plan must start at least one endpoint")
        if self.device_delay is not None and not (self.start_cloud and self.start_device):
            raise ValueError("device_delay only applies when both endpoints are planned")

    @property
    def race(self) -> bool:
        """Both endpoints start at once."""
        return self.start_cloud and self.start_device and self.device_delay == 0.0


def _cloud(policy: str, reason: str) -> DispatchPlan:
    return DispatchPlan(True, False, None, policy, reason)


def _device(policy: str, reason: str) -> DispatchPlan:
    return DispatchPlan(False, True, None, policy, reason)


def _both(policy: str, delay: float, reason: str) -> DispatchPlan:
    return DispatchPlan(True, True, float(delay), policy, reason)


def unshared(plan: DispatchPlan, device_ttft: float, cloud_ttft: float | None) -> DispatchPlan:
    """`plan` for a cloud that shares the device's hardware: never both endpoints at once.

    In a race on shared cores each endpoint computes at about half its speed, so its first token comes at ≈ 2·T
    where T is its time alone: min(2·T_d, 2·T_c) ≥ min(T_d, T_c), and the race never beats the faster endpoint alone.
    So a race keeps the endpoint predicted first (device_ttft, cloud_ttft: each one's expected TTFT alone for this
    prompt; cloud_ttft None while the cloud's is unmeasured: the device, whose model is the small one, is kept), and
    DiSCo-D's delayed device start, a hedge that would slow the cloud it hedges, is dropped. Either way the
    constrained endpoint does no more than the plan allowed it, so the budget holds."""
    if not (plan.start_cloud and plan.start_device):
        return plan
    if plan.device_delay:  # > 0: the cloud first, the device only as a hedge
        return _cloud(plan.policy, f"{plan.reason}; co-located cloud: no delayed device start")
    if cloud_ttft is None or device_ttft <= cloud_ttft:
        why = "the cloud's TTFT unmeasured" if cloud_ttft is None else f"{device_ttft:.3f}s ≤ {cloud_ttft:.3f}s"
        return _device(plan.policy, f"{plan.reason}; co-located cloud: no race, the device first ({why})")
    return _cloud(
        plan.policy,
        f"{plan.reason}; co-located cloud: no race, the cloud first ({cloud_ttft:.3f}s < {device_ttft:.3f}s)",
    )


def beyond_reach(
    plan: DispatchPlan, device_ttft: float, cloud_slowest: float | None, floor: float = BEYOND_REACH_SECONDS
) -> DispatchPlan:
    """`plan` without a device start that cannot win: its first token predicted (`device_ttft`, after the plan's
    delay) later than the cloud's slowest (`cloud_slowest`, its window's largest TTFT; None while unmeasured: the plan
    stands) and than `floor`. It would prefill what nothing uses (on a long prompt, minutes that a cancel cannot cut
    short and every later device request waits behind), so the cloud runs alone. The budget holds."""
    if not (plan.start_cloud and plan.start_device) or cloud_slowest is None:
        return plan
    wait = plan.device_delay or 0.0
    if wait + device_ttft <= max(cloud_slowest, floor):
        return plan
    after = f" after its {wait:.3f}s wait" if wait else ""
    return _cloud(
        plan.policy,
        f"{plan.reason}; the device cannot win: its first token predicted in {device_ttft:.3f}s{after}, the cloud's "
        f"slowest {cloud_slowest:.3f}s",
    )


def _check_budget(budget: float, alpha: float) -> None:
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"budget ratio must be in [0, 1], got {budget!r}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"tail ratio alpha must be in (0, 1), got {alpha!r}")


def length_histogram(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Support of p(l) ascending and the count of each length.

    Token counts are small non-negative integers, so bincount (O(n)) replaces a
    sort; absurdly long prompts fall back to np.unique.
    """
    x = np.asarray(lengths)
    if x.size == 0:
        raise ValueError("no prompt-length samples")
    if x.dtype.kind != "i" and x.dtype.kind != "u":
        x = np.rint(x).astype(np.int64)
    if x.min() < 0:
        raise ValueError("prompt lengths must be non-negative")
    if x.max() > (1 << 22):
        vals, cnt = np.unique(x, return_counts=True)
        return vals, cnt
    counts = np.bincount(x)
    vals = np.flatnonzero(counts)
    return vals, counts[vals]


class DispatchPolicy:
    """Base: `recompute` from samples + budget, then cheap `decide` per request."""

    name: ClassVar[str] = ""
    needs_samples: ClassVar[bool] = False  # whether recompute reads prompt lengths / TTFTs

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng if rng is not None else random.Random()
        self.budget: float | None = None
        self.alpha = DEFAULT_ALPHA

    @property
    def ready(self) -> bool:
        return self.budget is not None

    def recompute(
        self,
        *,
        prompt_lengths: np.ndarray | None = None,
        server_ttft: np.ndarray | None = None,
        budget: float,
        alpha: float = DEFAULT_ALPHA,
        side: Side | None = None,
    ) -> None:
        """Re-derive the policy's thresholds. Samples are read, not kept."""
        _check_budget(budget, alpha)
        self.budget, self.alpha = float(budget), float(alpha)

    def recompute_from(
        self,
        estimators: Estimators,
        cloud: str,
        *,
        budget: float,
        alpha: float = DEFAULT_ALPHA,
        side: Side | None = None,
    ) -> None:
        """`recompute` with the live estimators' current samples (cloud = which backend's TTFTs)."""
        self.recompute(
            prompt_lengths=estimators.prompt_lengths.samples(),
            server_ttft=estimators.server(cloud).samples(),
            budget=budget,
            alpha=alpha,
            side=side,
        )

    def decide(self, length: int, u: float | None = None) -> DispatchPlan:
        raise NotImplementedError

    def describe(self) -> dict[str, object]:
        """The current thresholds, for logs and the budget endpoint."""
        return {"policy": self.name, "budget": self.budget, "alpha": self.alpha}

    def _require_ready(self) -> None:
        if self.budget is None:
            raise RuntimeError(f"{self.name}: call recompute() before decide()")


class _Fixed(DispatchPolicy):
    """Every request to the same place, whatever the budget; ready without a recompute."""

    _PLAN: ClassVar[DispatchPlan]
    _SERVER_SHARE: ClassVar[float]  # the budget it starts with: the share of the requests' tokens it sends the server

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.budget = self._SERVER_SHARE

    def decide(self, length: int, u: float | None = None) -> DispatchPlan:
        return self._PLAN


class ServerOnly(_Fixed):
    """Every request on the cloud (the paper's vLLM baseline)."""

    name = "server-only"
    _PLAN = _cloud("server-only", "server-only policy")
    _SERVER_SHARE = 1.0


class DeviceOnly(_Fixed):
    """Every request on the device (the paper's llama.cpp baseline)."""

    name = "device-only"
    _PLAN = _device("device-only", "device-only policy")
    _SERVER_SHARE = 0.0


class _Stoch(DispatchPolicy):
    """Random routing (§5.1): a share b of requests goes to the constrained endpoint (racing the
    other one when `race`), the rest to the other endpoint only."""

    constrained: ClassVar[str]  # "server" | "device"

    def __init__(self, rng: random.Random | None = None, *, race: bool = False) -> None:
        super().__init__(rng)
        self.race = race
        on_constrained, on_other = (_cloud, _device) if self.constrained == "server" else (_device, _cloud)
        other = "device" if self.constrained == "server" else "server"
        self._chosen = (
            _both(self.name, 0.0, f"{self.name}: drawn for the {self.constrained}, racing")
            if race
            else on_constrained(self.name, f"{self.name}: drawn for the {self.constrained}")
        )
        self._other = on_other(self.name, f"{self.name}: drawn for the {other}")

    def decide(self, length: int, u: float | None = None) -> DispatchPlan:
        self._require_ready()
        if u is None:
            u = self._rng.random()
        return self._chosen if u < self.budget else self._other


class StochS(_Stoch):
    """Server-constrained random routing: share b of requests to the server, the rest to the device."""

    name = "stoch-s"
    constrained = "server"


class StochD(_Stoch):
    """Device-constrained random routing: share b of requests to the device, the rest to the server."""

    name = "stoch-d"
    constrained = "device"


class DiscoS(DispatchPolicy):
    """DiSCo-S: length threshold (Eq. 3, Alg. 3). Short → device only; long → race."""

    name = "disco-s"
    needs_samples = True

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.threshold = math.inf  # lengths below: device only; above: race
        self.tie_fraction = 1.0  # share of prompts of exactly `threshold` tokens kept on the device
        self._device_plan = _device(self.name, "disco-s: shorter than l_th, device only")
        self._race_plan = _both(self.name, 0.0, "disco-s: at least l_th, race both")

    def recompute(
        self,
        *,
        prompt_lengths: np.ndarray | None = None,
        server_ttft: np.ndarray | None = None,
        budget: float,
        alpha: float = DEFAULT_ALPHA,
        side: Side | None = None,
    ) -> None:
        _check_budget(budget, alpha)
        if prompt_lengths is None:
            raise ValueError("disco-s needs prompt-length samples")
        vals, cnt = length_histogram(prompt_lengths)
        tokens = vals * cnt.astype(np.float64)
        total = float(tokens.sum())
        if budget >= 1.0 or total == 0.0:
            threshold, frac = -1.0, 0.0  # everything races
        elif budget <= 0.0:
            threshold, frac = math.inf, 1.0  # the server gets nothing, however long the prompt
        else:
            # Eq. 3: device-only tokens Σ_{l<l_th} l·p(l) = (1 − b)·Σ l·p(l).
            target = (1.0 - budget) * total
            cum = np.cumsum(tokens)
            j = min(int(np.searchsorted(cum, target * (1 - 1e-12), side="left")), len(vals) - 1)
            below = float(cum[j - 1]) if j > 0 else 0.0
            threshold = float(vals[j])
            frac = min(1.0, max(0.0, (target - below) / float(tokens[j]))) if tokens[j] > 0 else 1.0
        self.threshold, self.tie_fraction = threshold, frac
        self.budget, self.alpha = float(budget), float(alpha)

    def decide(self, length: int, u: float | None = None) -> DispatchPlan:
        self._require_ready()
        if length < self.threshold:
            return self._device_plan
        if length > self.threshold:
            return self._race_plan
        if u is None:
            u = self._rng.random()
        return self._device_plan if u < self.tie_fraction else self._race_plan

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "l_th": self.threshold, "tie_fraction": self.tie_fraction}


class DiscoD(DispatchPolicy):
    """DiSCo-D: cloud first, device after a length-dependent wait w(l) (Alg. 2)."""

    name = "disco-d"
    needs_samples = True

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.w_tail = math.inf
        self.w_partial = math.inf
        self.partial_length = -1.0  # lengths below: w = 0; equal: w_partial; above: w_tail
        self.tail_share = 0.0  # P(T > w_tail) on the empirical CDF
        self._zero_plan = _both(self.name, 0.0, "disco-d: within the budget for immediate device start")
        self._partial_plan = self._zero_plan
        self._tail_plan = _cloud(self.name, "disco-d: no device budget")

    def recompute(
        self,
        *,
        prompt_lengths: np.ndarray | None = None,
        server_ttft: np.ndarray | None = None,
        budget: float,
        alpha: float = DEFAULT_ALPHA,
        side: Side | None = None,
    ) -> None:
        _check_budget(budget, alpha)
        if prompt_lengths is None or server_ttft is None:
            raise ValueError("disco-d needs prompt-length and server-TTFT samples")
        ttft = np.asarray(server_ttft, dtype=np.float64)
        if ttft.size == 0:
            raise ValueError("no server-TTFT samples")
        # Phase 1: tail protection.
        m = min(alpha, budget)
        if m <= 0.0:
            w_tail, q_tail = math.inf, 0.0  # no device budget: the device never starts
        else:
            w_tail = inverse_cdf(ttft, 1.0 - m)
            q_tail = float(np.count_nonzero(ttft > w_tail)) / ttft.size
        partial_length, w_partial = -1.0, w_tail
        # Phase 2: spend b − α on immediate starts for the shortest prompts.
        if budget > alpha:
            vals, cnt = length_histogram(prompt_lengths)
            tokens = vals * cnt.astype(np.float64)
            total = float(tokens.sum())
            avail = budget - q_tail
            if total > 0.0:
                cum = np.cumsum(tokens * ((1.0 - q_tail) / total))
                j = int(np.searchsorted(cum, avail * (1 + 1e-12), side="right"))  # lengths [0, j) fit entirely
                if j >= len(vals):
                    partial_length, w_partial = math.inf, 0.0
                else:
                    rest = avail - (float(cum[j - 1]) if j > 0 else 0.0)
                    # p(l)·l/E[l]·(P(T > w*) − q_tail) = rest  →  P(T > w*) = q_tail + rest·total/(l·count(l))
                    p_start = min(1.0, q_tail + rest * total / float(tokens[j]))
                    w_star = 0.0 if p_start >= 1.0 else inverse_cdf(ttft, 1.0 - p_start)
                    partial_length, w_partial = float(vals[j]), min(w_star, w_tail)
        self.w_tail, self.tail_share = w_tail, q_tail
        self.partial_length, self.w_partial = partial_length, w_partial
        self._partial_plan = self._plan_for(w_partial, "disco-d: at the budget boundary, partial wait")
        self._tail_plan = self._plan_for(w_tail, "disco-d: tail protection wait")
        self.budget, self.alpha = float(budget), float(alpha)

    def _plan_for(self, wait: float, reason: str) -> DispatchPlan:
        if math.isinf(wait):
            return _cloud(self.name, "disco-d: no device budget, cloud only")
        if wait <= 0.0:
            return self._zero_plan
        return _both(self.name, wait, f"{reason} w={wait:.3f}s")

    def wait(self, length: int) -> float:
        """w(l) in seconds (inf: the device never starts)."""
        if length < self.partial_length:
            return 0.0
        return self.w_partial if length == self.partial_length else self.w_tail

    def decide(self, length: int, u: float | None = None) -> DispatchPlan:
        self._require_ready()
        if length < self.partial_length:
            return self._zero_plan
        return self._partial_plan if length == self.partial_length else self._tail_plan

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "w_tail": self.w_tail,
            "tail_share": self.tail_share,
            "partial_length": self.partial_length,
            "w_partial": self.w_partial,
        }


class Disco(DispatchPolicy):
    """DiSCo with the variant chosen by the constrained side (Alg. 1)."""

    name = "disco"
    needs_samples = True

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self.s = DiscoS(self._rng)
        self.d = DiscoD(self._rng)
        self.active: DispatchPolicy = self.s
        self.side: Side | None = None

    def recompute(
        self,
        *,
        prompt_lengths: np.ndarray | None = None,
        server_ttft: np.ndarray | None = None,
        budget: float,
        alpha: float = DEFAULT_ALPHA,
        side: Side | None = None,
    ) -> None:
        if side not in SIDES:
            raise ValueError(
                f"disco needs the constrained side ('server' or 'device', see cost.constrained_side), got {side!r}"
            )
        self.active = self.s if side == "server" else self.d
        self.active.recompute(
            prompt_lengths=prompt_lengths, server_ttft=server_ttft, budget=budget, alpha=alpha, side=side
        )
        self.side, self.budget, self.alpha = side, float(budget), float(alpha)

    def decide(self, length: int, u: float | None = None) -> DispatchPlan:
        self._require_ready()
        return self.active.decide(length, u)

    def describe(self) -> dict[str, object]:
        return {**self.active.describe(), "policy": self.name, "variant": self.active.name, "side": self.side}


@dataclass(frozen=True)
class PolicyDeclaration:
    """What a routing policy is, declared once: the gateway looks a request's policy up here and asks it, never
    its name. The paper's baselines (server-only, device-only, Stoch) keep every answer where they started it and
    move one only on a fault; DiSCo also moves an answer when that saves cost (§4.3); `quality` also moves a
    device answer onto the cloud when the device is likely to get it wrong (policies/quality.py)."""

    name: str
    dispatch: type[DispatchPolicy]  # where a request starts
    aliases: tuple[str, ...] = ()
    side: Side | None = None  # the constrained side its name fixes; None: the operator's, else Alg. 1's from prices
    # Its plan is DiSCo's, a means to time and money: the start may move to where the request is better served
    # (tool_choice auto: the endpoint where a started call comes out whole). A baseline's plan is the experiment.
    by_disco: bool = False
    cost_migration: bool = False  # moves an answer mid-way when that saves cost (Eqs. 4-6)
    quality_migration: bool = False  # moves a device answer onto the cloud when the device falters
    # A device answer that writes again a tool call the conversation holds answered (a small model in an agent loop)
    # is a fault: the call is never delivered and the answer goes on on the cloud. Every policy that can reach a
    # cloud says so; device-only delivers the call as written (it promised the device).
    escapes_loops: bool = True
    needs_cloud: bool = True
    # The one endpoint of the pair its plans start every answer on ("device" | "cloud"); None: either. A prompt that
    # endpoint cannot hold is refused, never sent to the other (app/serving/windows.py).
    only_on: str | None = None


DECLARATIONS: tuple[PolicyDeclaration, ...] = (
    PolicyDeclaration("disco", Disco, by_disco=True, cost_migration=True),
    PolicyDeclaration("disco-s", DiscoS, side="server", by_disco=True, cost_migration=True),
    PolicyDeclaration("disco-d", DiscoD, side="device", by_disco=True, cost_migration=True),
    PolicyDeclaration("quality", Disco, by_disco=True, cost_migration=True, quality_migration=True),
    PolicyDeclaration("server-only", ServerOnly, aliases=("cloud",), only_on="cloud"),
    PolicyDeclaration(
        "device-only", DeviceOnly, aliases=("device",), escapes_loops=False, needs_cloud=False, only_on="device"
    ),
    PolicyDeclaration("stoch-s", StochS, side="server"),
    PolicyDeclaration("stoch-d", StochD, side="device"),
)
_BY_NAME: dict[str, PolicyDeclaration] = {
    key: d for d in DECLARATIONS for key in (d.name, *d.aliases)
}  # fmt: skip
POLICY_NAMES: tuple[str, ...] = (*(d.name for d in DECLARATIONS), *(a for d in DECLARATIONS for a in d.aliases))


def declaration(name: str) -> PolicyDeclaration:
    """A policy by name or alias (any case, surrounding blanks ignored); ValueError naming the known ones."""
    found = _BY_NAME.get(name.strip().lower())
    if found is None:
        raise ValueError(f"unknown dispatch policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
    return found


def canonical_name(name: str) -> str:
    """Resolve aliases; raise ValueError naming the known policies for anything else."""
    return declaration(name).name


def make_policy(name: str, rng: random.Random | None = None) -> DispatchPolicy:
    """A fresh dispatch policy for a policy's name or alias."""
    return declaration(name).dispatch(rng)


def variant_for_side(side: Side) -> str:
    """Alg. 1's choice as a policy name."""
    return "disco-s" if side == "server" else "disco-d"
