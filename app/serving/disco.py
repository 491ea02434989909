"""DiSCo's live state in the gateway: estimators fed by real requests, the dispatch
policies recomputed from them, and the cost model of the (device, cloud) pair.

The decisions themselves are the pure functions of `policies/` — the trace
simulator (`tandem bench disco`) calls the very same ones. This module only keeps
their inputs current and reads the clock.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

from app.serving.budget import BudgetSettings, pinned_side
from app.serving.ledger import Ledger
from clients.base import Usage
from policies.cost import CostModel, DeviceEnergy, ModelArch, Side, TokenPrices
from policies.dispatch import DispatchPlan, DispatchPolicy, canonical_name, make_policy, unshared
from policies.estimate import Estimators
from policies.migration import MigrationDecision, buffer_tokens, should_migrate

log = logging.getLogger(__name__)


class DiscoRuntime:
    """One device, one or more cloud endpoints. Each request plays DiSCo between the device
    and one cloud (the primary unless the request names another): estimators, cost model,
    constrained side and policy thresholds are kept per cloud.

    The knobs are the ledger's `BudgetSettings`, read from it at start and on every change (the ledger tells
    the runtime; nothing flows back). This is the one place that resolves the constrained side."""

    def __init__(
        self,
        ledger: Ledger,
        primary: str | None,
        device_arch: ModelArch,
        window: int = 2000,
        recompute_every: int = 10,
        rng: random.Random | None = None,
        co_located: frozenset[str] = frozenset(),
    ):
        self.ledger = ledger
        self.primary = primary
        self.co_located = co_located  # the clouds that compute on the device's own hardware (`[clouds.x] co_located`)
        self.energy = DeviceEnergy.from_arch(device_arch)
        self.estimators = Estimators(window=window)
        self.recompute_every = recompute_every
        self._rng = rng or random.Random()
        self._policies: dict[tuple[str, str], DispatchPolicy] = {}
        self._since_recompute = 0
        self._server_ttft_listeners: list[Callable[[str, float], None]] = []
        self.apply(ledger.settings)
        ledger.on_change(lambda: self.apply(ledger.settings))

    # -- knobs and derived state -----------------------------------------------------------------
    def apply(self, settings: BudgetSettings) -> None:
        self.settings = settings
        self._costs = {name: settings.cost_model(name, self.energy) for name in settings.prices}
        self._recompute_all()

    def cost(self, cloud: str) -> CostModel:
        if cloud not in self._costs:  # a cloud without a price: free, so the device is the dear side
            self._costs[cloud] = CostModel(TokenPrices(0.0, 0.0), self.energy, self.settings.lam_usd_per_flop)
        return self._costs[cloud]

    def side(self, cloud: str | None = None, policy: str | None = None) -> Side:
        """The constrained side of a request DiSCo plays against `cloud` under `policy` (the configured one if
        None): fixed by the policy's name (the -s / -d variants) or by the operator, else Alg. 1 from prices.
        Dispatch, booking and GET /v1/budget all ask here."""
        pinned = pinned_side(policy or self.settings.policy, self.settings.constrained_side)
        return pinned or self.cost(cloud or self.primary or "cloud").constrained_side()

    def _recompute(self, key: tuple[str, str]) -> None:
        policy, cloud = key
        self._policies[key].recompute_from(
            self.estimators,
            cloud,
            budget=self.settings.budget,
            alpha=self.settings.alpha,
            side=self.side(cloud, policy),
        )

    def _recompute_all(self) -> None:
        for key in self._policies:
            self._recompute(key)
        self._since_recompute = 0

    def policy(self, name: str, cloud: str | None = None) -> DispatchPolicy:
        key = (canonical_name(name), cloud or self.primary or "cloud")
        if key not in self._policies:
            self._policies[key] = make_policy(key[0], self._rng)
            self._recompute(key)
        return self._policies[key]

    # -- decisions ---------------------------------------------------------------------------------
    def plan(self, policy_name: str, prompt_tokens: int, cloud: str | None) -> DispatchPlan:
        if cloud is None:
            return DispatchPlan(False, True, None, "device-only", "no cloud backend configured")
        plan = self.policy(policy_name, cloud).decide(prompt_tokens)
        if cloud in self.co_located:
            ttft = self.estimators.server(cloud)
            measured = ttft.quantile(0.5) if ttft.count >= ttft.min_samples else None
            plan = unshared(plan, self.estimators.device_ttft.predict(prompt_tokens), measured)
        return plan

    def migration_time(self, target_role: str, cloud: str, context_tokens: int) -> float:
        """t_m: the target's prefill of prompt + delivered tokens, i.e. its time to first token."""
        if target_role == "device":
            return self.estimators.device_ttft.predict(context_tokens)
        ttft = self.estimators.server(cloud)
        return self.estimators.migration_times.estimate(cloud, prior=ttft.quantile(0.5))

    def check_migration(
        self,
        source_role: str,
        target_role: str,
        cloud: str,
        prompt_tokens: int,
        delivered: int,
        max_tokens: int,
        lead: float,
        cached_tokens: float = 0,
    ) -> MigrationDecision:
        t_m = self.migration_time(target_role, cloud, prompt_tokens + delivered - cached_tokens)
        cost = self.cost(cloud)
        src, dst = cost.prices(source_role), cost.prices(target_role)
        cached_price = 0.0  # the device's own KV cache: no energy spent on it
        if target_role == "cloud":
            # The cloud is sent the whole context again; its provider bills the share it reads from its prompt
            # cache (as its usage reports show) at the cached-input price, and the rest at the input price.
            cached_tokens = self.estimators.cached_share(cloud) * (prompt_tokens + delivered)
            cached_price = dst.cached_prefill
        return should_migrate(
            source=source_role,
            target=target_role,
            source_decode_price=src.decode,
            target_decode_price=dst.decode,
            target_prefill_price=dst.prefill,
            prompt_tokens=prompt_tokens,
            delivered_tokens=delivered,
            expected_remaining=self.estimators.output_lengths.expected_remaining(delivered, max_tokens=max_tokens),
            cached_tokens=cached_tokens,
            target_cached_price=cached_price,
            client_lead=lead,
            buffer=buffer_tokens(self.settings.consumption_rate, t_m),
        )

    def cost_of(
        self,
        role: str,
        cloud: str,
        prefill_tokens: int,
        decode_tokens: int,
        *,
        cached_tokens: int = 0,
        reasoning_tokens: int = 0,
    ) -> float:
        """Eq. 8's term of one endpoint's work: a cloud's at its prices (cached and reasoning tokens, parts of the
        two counts, at theirs), the device's energy at λ."""
        cost = self.cost(cloud)
        if role == "cloud":
            return cost.server_cost(
                prefill_tokens, decode_tokens, cached_tokens=cached_tokens, reasoning_tokens=reasoning_tokens
            )
        return cost.device_cost(prefill_tokens, decode_tokens)

    # -- observations (fed live by the orchestrator) --------------------------------------------------
    def observe_request(self, prompt_tokens: int) -> None:
        self.estimators.prompt_lengths.add(prompt_tokens)
        self._since_recompute += 1
        if self._since_recompute >= self.recompute_every:
            self._recompute_all()

    def observe_first_token(
        self, role: str, cloud: str | None, context_tokens: int, seconds: float, migration: bool
    ) -> None:
        """A first token: `cloud` names the cloud endpoint for role "cloud"."""
        if migration:
            self.estimators.migration_times.add(cloud if role == "cloud" else "device", seconds)
        if role == "device":
            self.estimators.device_ttft.add(context_tokens, seconds)
        elif not migration:
            self.estimators.server(cloud).add(seconds)
            for share in self._server_ttft_listeners:
                share(cloud, seconds)

    def on_server_ttft(self, callback: Callable[[str, float], None]) -> None:
        """Call `callback(cloud, seconds)` after every cloud TTFT sample (a shared store's copy, for other replicas)."""
        self._server_ttft_listeners.append(callback)

    def warm(self, samples: dict[str, list[float]]) -> None:
        """Cloud TTFT samples other replicas measured (oldest first), so a new replica starts from them."""
        for cloud, values in samples.items():
            for seconds in values:
                self.estimators.server(cloud).add(seconds)

    def observe_usage(self, cloud: str, usage: Usage) -> None:
        """A cloud's own usage report: how much of what it was sent its provider read from its prompt cache."""
        self.estimators.observe_prompt_cache(cloud, usage.prompt_tokens, usage.cached_tokens)

    def observe_output(self, tokens: int) -> None:
        self.estimators.output_lengths.add(tokens)

    def describe(self) -> dict:
        cloud = self.primary or "cloud"
        return {
            "constrained_side": self.side(cloud),
            "device_prices_usd_per_mtok": _per_million(self.cost(cloud).device),
            "device_flops_per_token": {
                "prefill": self.energy.prefill_per_token,
                "decode": self.energy.decode_per_token,
            },
            "policy_state": _plain(self.policy(self.settings.policy, cloud).describe()),
            "estimates": {
                "device_ttft_line": {
                    "seconds_per_token": float(self.estimators.device_ttft.k),
                    "seconds": float(self.estimators.device_ttft.c),
                },
                "cloud_ttft_p50": float(self.estimators.server(cloud).quantile(0.5)),
                "cloud_ttft_p99": float(self.estimators.server(cloud).quantile(0.99)),
                "cloud_ttft_samples": self.estimators.server(cloud).count,
                "prompt_samples": self.estimators.prompt_lengths.count,
            },
        }


def _per_million(prices: TokenPrices) -> dict:
    return {"prefill": prices.prefill * 1e6, "decode": prices.decode * 1e6}


def _plain(d: dict) -> dict:
    """JSON-ready: numpy scalars and arrays become Python numbers and lists."""
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in d.items()}
