"""DiSCo's live state in the gateway: estimators fed by real requests, the dispatch
policies recomputed from them, and the cost model of the (device, cloud) pair.

The decisions themselves are the pure functions of `policies/` — the trace
simulator (`tandem bench disco`) calls the very same ones. This module only keeps
their inputs current and reads the clock.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from policies.cost import CostModel, DeviceEnergy, ModelArch, Side, TokenPrices, usd_per_pflop
from policies.dispatch import DispatchPlan, DispatchPolicy, canonical_name, make_policy
from policies.estimate import Estimators
from policies.migration import MigrationDecision, buffer_tokens, should_migrate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiscoKnobs:
    """The user-set part of DiSCo (GET/PUT /v1/budget)."""

    policy: str
    side: str  # "auto" | "server" | "device"
    budget: float
    alpha: float
    exchange_rate: float  # λ in USD per 10^15 FLOPs
    consumption_rate: float  # r_c, tokens/s
    cloud_prices: TokenPrices  # USD per token
    migration: bool = True


class DiscoRuntime:
    def __init__(
        self,
        cloud: str | None,
        device_arch: ModelArch,
        knobs: DiscoKnobs,
        window: int = 2000,
        recompute_every: int = 10,
        rng: random.Random | None = None,
    ):
        self.cloud = cloud
        self.energy = DeviceEnergy.from_arch(device_arch)
        self.estimators = Estimators(window=window)
        self.recompute_every = recompute_every
        self._rng = rng or random.Random()
        self._policies: dict[str, DispatchPolicy] = {}
        self._since_recompute = 0
        self.set_knobs(knobs)

    # -- knobs and derived state -----------------------------------------------------------------
    def set_knobs(self, knobs: DiscoKnobs) -> None:
        self.knobs = knobs
        self.cost = CostModel(knobs.cloud_prices, self.energy, usd_per_pflop(knobs.exchange_rate))
        self.side: Side = self.cost.constrained_side(None if knobs.side == "auto" else knobs.side)
        self._recompute_all()

    def _recompute(self, policy: DispatchPolicy) -> None:
        policy.recompute_from(
            self.estimators, self.cloud or "cloud", budget=self.knobs.budget, alpha=self.knobs.alpha, side=self.side
        )

    def _recompute_all(self) -> None:
        for policy in self._policies.values():
            self._recompute(policy)
        self._since_recompute = 0

    def policy(self, name: str) -> DispatchPolicy:
        key = canonical_name(name)
        if key not in self._policies:
            self._policies[key] = make_policy(key, self._rng)
            self._recompute(self._policies[key])
        return self._policies[key]

    # -- decisions ---------------------------------------------------------------------------------
    def plan(self, policy_name: str, prompt_tokens: int) -> DispatchPlan:
        if self.cloud is None:
            return DispatchPlan(False, True, None, "device-only", "no cloud backend configured")
        return self.policy(policy_name).decide(prompt_tokens)

    def endpoint_prices(self, role: str) -> TokenPrices:
        return self.cost.prices(role)  # "cloud" | "device"

    def migration_time(self, target_role: str, context_tokens: int) -> float:
        """t_m: the target's prefill of prompt + delivered tokens, i.e. its time to first token."""
        if target_role == "device":
            return self.estimators.device_ttft.predict(context_tokens)
        ttft = self.estimators.server(self.cloud or "cloud")
        return self.estimators.migration_times.estimate("cloud", prior=ttft.quantile(0.5))

    def check_migration(
        self, source_role: str, target_role: str, prompt_tokens: int, delivered: int, max_tokens: int, lead: float
    ) -> MigrationDecision:
        t_m = self.migration_time(target_role, prompt_tokens + delivered)
        src, dst = self.endpoint_prices(source_role), self.endpoint_prices(target_role)
        return should_migrate(
            source=source_role,
            target=target_role,
            source_decode_price=src.decode,
            target_decode_price=dst.decode,
            target_prefill_price=dst.prefill,
            prompt_tokens=prompt_tokens,
            delivered_tokens=delivered,
            expected_remaining=self.estimators.output_lengths.expected_remaining(delivered, max_tokens=max_tokens),
            client_lead=lead,
            buffer=buffer_tokens(self.knobs.consumption_rate, t_m),
        )

    def cost_of(self, role: str, prefill_tokens: int, decode_tokens: int) -> float:
        if role == "cloud":
            return self.cost.server_cost(prefill_tokens, decode_tokens)
        return self.cost.device_cost(prefill_tokens, decode_tokens)

    # -- observations (fed live by the orchestrator) --------------------------------------------------
    def observe_request(self, prompt_tokens: int) -> None:
        self.estimators.prompt_lengths.add(prompt_tokens)
        self._since_recompute += 1
        if self._since_recompute >= self.recompute_every:
            self._recompute_all()

    def observe_first_token(self, role: str, context_tokens: int, seconds: float, migration: bool) -> None:
        if migration:
            self.estimators.migration_times.add(role, seconds)
        if role == "device":
            self.estimators.device_ttft.add(context_tokens, seconds)
        elif not migration:
            self.estimators.server(self.cloud or "cloud").add(seconds)

    def observe_output(self, tokens: int) -> None:
        self.estimators.output_lengths.add(tokens)

    def describe(self) -> dict:
        policy = self.policy(self.knobs.policy)
        return {
            "constrained_side": self.side,
            "device_prices_usd_per_mtok": _per_million(self.cost.device),
            "device_flops_per_token": {
                "prefill": self.energy.prefill_per_token,
                "decode": self.energy.decode_per_token,
            },
            "policy_state": _plain(policy.describe()),
            "estimates": {
                "device_ttft_line": {"k": self.estimators.device_ttft.k, "c": self.estimators.device_ttft.c},
                "cloud_ttft_p50": self.estimators.server(self.cloud or "cloud").quantile(0.5),
                "cloud_ttft_p99": self.estimators.server(self.cloud or "cloud").quantile(0.99),
                "prompt_samples": self.estimators.prompt_lengths.count,
            },
        }


def _per_million(prices: TokenPrices) -> dict:
    return {"prefill": prices.prefill * 1e6, "decode": prices.decode * 1e6}


def _plain(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if hasattr(v, "tolist"):
            v = v.tolist()
        out[k] = v
    return out
