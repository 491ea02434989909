"""DiSCo's live state in the gateway: estimators fed by real requests, the dispatch
policies recomputed from them, and the cost model of the (device, cloud) pair.

The decisions themselves are the pure functions of `policies/` — the trace
simulator (`tandem bench disco`) calls the very same ones. This module only keeps
their inputs current and reads the clock.

Plans count caches (`outlook`): the device's prefill is priced and timed over the tokens it would evaluate (its cache
index says exactly which it holds), a cloud's over what its prompt cache is expected to hold of the conversation
(policies/estimate.py's CloudPromptCaches, learned from its usage reports); the policy decides on the device's length.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace

from app.serving.budget import BudgetSettings, pinned_side
from app.serving.ledger import Ledger
from clients.base import GenerationRequest, Usage
from policies.cost import CostModel, DeviceEnergy, ModelArch, Side, TokenPrices
from policies.dispatch import (
    DispatchPlan,
    DispatchPolicy,
    Outlook,
    beyond_reach,
    canonical_name,
    make_policy,
    unshared,
)
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
    def outlook(
        self, prompt_tokens: int, cloud: str | None, device_cached: int = 0, conversation: str | None = None
    ) -> Outlook:
        """Each endpoint's view of a prompt: what it holds in a cache, its expected TTFT and prefill cost. The device
        holds `device_cached` leading tokens (its cache index); `cloud` what its prompt cache is expected to keep of
        `conversation` (its usage reports)."""
        held = min(max(0, device_cached), prompt_tokens)
        evaluated = prompt_tokens - held
        cost = self.cost(cloud or self.primary or "cloud")
        cloud_cached, cloud_ttft, cloud_cost = 0.0, None, 0.0
        if cloud is not None:
            cloud_cached = self.estimators.prompt_caches.expected(cloud, conversation, prompt_tokens)
            cloud_ttft = self.cloud_ttft(cloud, prompt_tokens - cloud_cached, cloud_cached)
            cloud_cost = cost.server_cost(prompt_tokens, 0, cached_tokens=cloud_cached)
        return Outlook(
            prompt_tokens,
            held,
            cloud_cached,
            device_ttft=self.estimators.device_ttft.predict(evaluated, held),
            cloud_ttft=cloud_ttft,
            device_prefill_cost=cost.device_cost(evaluated, 0),
            cloud_prefill_cost=cloud_cost,
        )

    def cloud_ttft(self, cloud: str, tokens: float, held: float = 0.0) -> float | None:
        """A cloud's expected TTFT for a prompt of which it evaluates `tokens` after `held`: a co-located cloud's its
        pace times the device line's; a remote cloud's median (DiSCo's model: its TTFT a distribution, not a function
        of the prompt); None while unmeasured."""
        if cloud in self.co_located:
            return self.estimators.co_located_ttft(cloud, tokens, held)
        ttft = self.estimators.server(cloud)
        return ttft.quantile(0.5) if ttft.count >= ttft.min_samples else None

    def plan(
        self,
        policy_name: str,
        prompt_tokens: int,
        cloud: str | None,
        *,
        device_cached: int = 0,
        conversation: str | None = None,
    ) -> DispatchPlan:
        """Where a request starts: the policy's plan for the tokens the device would evaluate, a co-located cloud never
        beside the device, a device start that cannot win dropped; the plan carries its `outlook`."""
        outlook = self.outlook(prompt_tokens, cloud, device_cached, conversation)
        if cloud is None:
            return DispatchPlan(False, True, None, "device-only", "no cloud backend configured", outlook)
        plan = self.policy(policy_name, cloud).decide(outlook.device_tokens)
        if cloud in self.co_located:
            plan = unshared(plan, outlook.device_ttft, outlook.cloud_ttft)
        else:
            ttft = self.estimators.server(cloud)
            slowest = ttft.quantile(1.0) if ttft.count >= ttft.min_samples else None
            plan = beyond_reach(plan, outlook.device_ttft, slowest)
        return replace(plan, outlook=outlook)

    def migration_time(self, target_role: str, cloud: str, context_tokens: int, held: float = 0.0) -> float:
        """t_m: the target's prefill of the context it does not hold (`context_tokens`, after `held`), i.e. its time
        to first token."""
        if target_role == "device":
            return self.estimators.device_ttft.predict(context_tokens, held)
        prior = self.cloud_ttft(cloud, context_tokens, held)
        if prior is None:
            prior = self.estimators.server(cloud).quantile(0.5)
        return self.estimators.migration_times.estimate(cloud, prior=prior)

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
        conversation: str | None = None,
    ) -> MigrationDecision:
        """Eqs. 4-6 for moving the answer onto `target_role` now. `cached_tokens`: what the device holds of the
        context in its KV cache (a device target: free, and not prefilled); a cloud target's share is what its prompt
        cache is expected to hold of `conversation` (billed at its cached price, and not prefilled either)."""
        context = prompt_tokens + delivered
        cost = self.cost(cloud)
        src, dst = cost.prices(source_role), cost.prices(target_role)
        cached_price = 0.0  # the device's own KV cache: no energy spent on it
        if target_role == "cloud":
            # The cloud is sent the whole context again; its provider bills the part it reads from its prompt cache
            # at the cached-input price, and the rest at the input price.
            cached_tokens = self.estimators.prompt_caches.expected(cloud, conversation, context)
            cached_price = dst.cached_prefill
        cached_tokens = min(max(0.0, cached_tokens), context)
        t_m = self.migration_time(target_role, cloud, context - cached_tokens, cached_tokens)
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
        self, role: str, cloud: str | None, context_tokens: int, seconds: float, migration: bool, held: float = 0.0
    ) -> None:
        """A first token `seconds` after the start of a prefill of `context_tokens` that followed `held` tokens taken
        from a cache: `cloud` names the cloud endpoint for role "cloud"."""
        if migration:
            self.estimators.migration_times.add(cloud if role == "cloud" else "device", seconds)
        if role == "device":
            self.estimators.device_ttft.add(context_tokens, seconds, held)
        elif not migration:
            self.estimators.server(cloud).add(seconds)
            if cloud in self.co_located:
                self.estimators.observe_co_located(cloud, context_tokens, held, seconds)
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

    def observe_usage(
        self, cloud: str, usage: Usage | None, conversation: str | None = None, context_tokens: int | None = None
    ) -> None:
        """A cloud attempt's end: it was sent `context_tokens` of `conversation` (its provider may keep them for the
        conversation's next turn) and, in its usage report, said how much of what it was sent its provider read from
        its prompt cache."""
        if usage is None:
            if context_tokens:
                self.estimators.prompt_caches.observe(cloud, conversation, context_tokens)
            return
        self.estimators.observe_prompt_cache(
            cloud, usage.prompt_tokens, usage.cached_tokens, conversation, context_tokens
        )

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
                    "seconds_per_attention_pair": float(self.estimators.device_ttft.q),
                    "seconds": float(self.estimators.device_ttft.c),
                },
                "cloud_ttft_p50": float(self.estimators.server(cloud).quantile(0.5)),
                "cloud_ttft_p99": float(self.estimators.server(cloud).quantile(0.99)),
                "cloud_ttft_samples": self.estimators.server(cloud).count,
                "cloud_prompt_cache": self.estimators.prompt_caches.describe(cloud),
                "prompt_samples": self.estimators.prompt_lengths.count,
            },
        }


def conversation_key(gen: GenerationRequest) -> str | None:
    """The conversation a request belongs to, as the clouds' prompt caches know it: the client's `prompt_cache_key`,
    else the one the gateway derived (app/serving/cache_key.py); None for a request without one."""
    key = gen.extras.get("prompt_cache_key") if gen.extras else None
    return key if isinstance(key, str) and key else gen.cache_key


def _per_million(prices: TokenPrices) -> dict:
    return {"prefill": prices.prefill * 1e6, "decode": prices.decode * 1e6}


def _plain(d: dict) -> dict:
    """JSON-ready: numpy scalars and arrays become Python numbers and lists."""
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in d.items()}
