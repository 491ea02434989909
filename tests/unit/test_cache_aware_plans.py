"""DiSCo plans with every endpoint's cache (issue 51 item 3), on scripted endpoints.

An agent's turn is a 10-20k-token prompt of which all but a few hundred tokens were sent before. Whether the device
holds that prefix (its prompt cache) decides whether it is the fast endpoint (a few hundred tokens to prefill) or the
slow one (minutes); whether a cloud's prompt cache holds it decides what the cloud's prefill costs and, for a cloud on
the device's own cores, how long it takes. These tests pin each link: the estimate moves with the cached prefix, a
cloud's cache is known per conversation (not as one share for all), the price counts only what is evaluated or billed
uncached, and the plan, the race and a migration's target all read it.

The timings are the embedded default's measured prefills (docs/bench/context-windows.md, 2 cores): the device's
Qwen2.5-Coder-0.5B at 1k / 4k / 12k tokens in 5.2 / 30.4 / 167 s, the embedded cloud's 1.5B in 10.4 / 69.8 / 272 s.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.serving.accounting import Accounting
from app.serving.budget import BudgetSettings, Price
from app.serving.disco import DiscoRuntime, conversation_key
from app.serving.job import Attempt, Job
from app.serving.ledger import Ledger
from app.serving.metrics import Metrics
from app.serving.orchestrator import Orchestrator
from clients.base import GenerationRequest, Usage
from clients.dialects import LLAMA_CPP
from policies.cost import QWEN2_5_0_5B
from policies.dispatch import DispatchPlan, beyond_reach

DEVICE_PREFILLS = [(16, 0.07), (128, 0.57), (512, 2.43), (1024, 5.17), (4096, 30.39), (12288, 167.0)]
CLOUD_PREFILLS = [(1024, 10.43), (4096, 69.8), (12288, 272.4)]  # the 1.5B with flash attention, on the same cores
PROMPT, HELD = 15_000, 14_800  # an agent's turn: 200 new tokens after what the last turn sent
M = 1e-6


def embedded_default(co_located: bool = True, budget: float = 0.5) -> DiscoRuntime:
    """The embedded default's knobs (deploy/embedded.toml: disco, b = 0.5, λ = 0.3, gpt-4o-mini's prices: the server
    side is constrained, so DiSCo-S) with its measured prefill times, the cloud co-located with the device or not."""
    settings = BudgetSettings(policy="disco", budget=budget, prices={"cloud": Price(0.15, 0.60, cached=0.075)})
    disco = DiscoRuntime(
        Ledger(None, settings), "cloud", QWEN2_5_0_5B, co_located=frozenset({"cloud"} if co_located else ())
    )
    for tokens, seconds in DEVICE_PREFILLS:
        disco.observe_first_token("device", None, tokens, seconds, migration=False)
    if co_located:
        for tokens, seconds in CLOUD_PREFILLS:
            disco.observe_first_token("cloud", "cloud", tokens, seconds, migration=False)
    return disco


def cloud_kept(disco: DiscoRuntime, conversation: str, tokens: int = HELD) -> None:
    """The cloud served `conversation`'s last turn (`tokens` of context), after its reports showed, on another
    conversation's second turn, that it keeps what it was sent."""
    disco.observe_usage("cloud", Usage(10_000, 5), "warm-up", 10_000)
    disco.observe_usage("cloud", Usage(10_300, 5, cached_tokens=9_984), "warm-up", 10_300)
    disco.observe_usage("cloud", Usage(tokens, 8), conversation, tokens)


def test_the_planners_ttft_estimate_moves_with_the_cached_prefix():
    disco = embedded_default()
    cold = disco.outlook(PROMPT, "cloud")
    assert cold.device_ttft == pytest.approx(234.5, rel=0.05)  # about four minutes of prefill on 2 cores
    estimates = [disco.outlook(PROMPT, "cloud", device_cached=held).device_ttft for held in (0, 5_000, 10_000, HELD)]
    assert estimates == sorted(estimates, reverse=True) and len(set(estimates)) == 4
    warm = disco.outlook(PROMPT, "cloud", device_cached=HELD)
    # Its 200 new tokens at their position's price: ~27 ms each after 14,800 held, not the start's ~4.4 ms.
    assert 4.0 < warm.device_ttft < 7.0 and warm.device_tokens == 200
    # The cloud's estimate moves with what its prompt cache holds of this conversation.
    assert disco.outlook(PROMPT, "cloud", conversation="agent").cloud_ttft > 300
    cloud_kept(disco, "agent")
    kept = disco.outlook(PROMPT, "cloud", conversation="agent")
    assert kept.cloud_cached == pytest.approx(HELD, rel=0.01) and 5 < kept.cloud_ttft < 20
    assert disco.outlook(PROMPT, "cloud", conversation="another").cloud_cached == 0  # per conversation


def test_a_15k_prompt_starts_on_the_device_when_it_holds_the_prefix_and_on_the_cloud_when_only_the_cloud_does():
    """The plan through the orchestrator, the device's cache read from its index (`cached_prefix`)."""
    disco = embedded_default()
    cloud_kept(disco, "agent")
    held = {"n": HELD}
    device = endpoint("device", cached_prefix=lambda ids: min(held["n"], len(ids) - 1))
    backends = {"device": device, "cloud": endpoint("cloud")}
    orchestrator = Orchestrator(backends, "device", "cloud", True, Metrics(), disco, None)

    on_device = orchestrator._plan(agent_turn("agent"))
    assert (on_device.start_device, on_device.start_cloud) == (True, False), on_device.reason
    assert on_device.outlook.device_cached == HELD and on_device.outlook.device_ttft < on_device.outlook.cloud_ttft
    held["n"] = 0  # the device holds none of it (another session evicted it, a fresh gateway)
    on_cloud = orchestrator._plan(agent_turn("agent"))
    assert (on_cloud.start_device, on_cloud.start_cloud) == (False, True), on_cloud.reason
    assert on_cloud.outlook.device_ttft > 200 > 20 > on_cloud.outlook.cloud_ttft
    # Neither holds it (a new conversation): the device's smaller model prefills it first.
    fresh = orchestrator._plan(agent_turn("new"))
    assert (fresh.start_device, fresh.start_cloud) == (True, False)
    assert fresh.outlook.cloud_ttft > fresh.outlook.device_ttft > 200
    # A baseline's plan does not depend on it: the device is not probed.
    device.cached_prefix = lambda ids: pytest.fail("probed for a baseline")
    job = agent_turn("agent")
    job.policy = "server-only"
    assert orchestrator._plan(job).start_cloud


def test_a_remote_cloud_runs_alone_where_the_device_cannot_win_and_a_warm_device_answers_alone():
    disco = embedded_default(co_located=False, budget=0.9)  # a provider that may take 90 % of the prompt tokens
    for i in range(40):  # its TTFTs: 0.3-1.5 s
        disco.observe_first_token("cloud", "cloud", PROMPT, 0.3 + 0.03 * i, migration=False)
    for i in range(41):  # an agent's traffic: 10k-20k-token prompts, so DiSCo-S's l_th is ~11k
        disco.observe_request(10_000 + 250 * i)
    disco._recompute_all()
    assert 10_000 < disco.policy("disco", "cloud").describe()["l_th"] < PROMPT
    cold = disco.plan("disco", PROMPT, "cloud")
    assert (cold.start_device, cold.start_cloud) == (False, True)
    assert "the device cannot win" in cold.reason and "1.470s" in cold.reason
    warm = disco.plan("disco", PROMPT, "cloud", device_cached=HELD)
    assert (warm.start_device, warm.start_cloud) == (True, False)  # 200 tokens to it: under l_th, device only
    # Before the cloud is measured the race stands; within reach it stands too.
    race = DispatchPlan(True, True, 0.0, "disco-s", "race")
    assert beyond_reach(race, 200.0, None) is race and beyond_reach(race, 1.0, 1.5) is race
    assert beyond_reach(race, 4.0, 1.5) is race  # it cannot win, but loses only seconds of device time
    hedge = DispatchPlan(True, True, 1.2, "disco-d", "hedge")
    assert beyond_reach(hedge, 0.5, 1.5, floor=0.0) is not hedge  # 1.2 s wait + 0.5 s: after the slowest


def test_a_clouds_prompt_cache_is_known_per_conversation_and_learned_from_its_reports():
    disco = embedded_default()
    caches = disco.estimators.prompt_caches
    disco.observe_usage("cloud", Usage(12_000, 5), "a", 12_000)  # turn 1 of a: nothing cached, nothing known yet
    assert caches.expected("cloud", "a", 12_300) == 0  # no report has shown yet that it keeps a prefix
    disco.observe_usage("cloud", Usage(12_300, 5, cached_tokens=11_904), "a", 12_300)  # turn 2: 128-token blocks
    assert caches.reliability("cloud") == pytest.approx((11_904 / 12_300) / (12_000 / 12_300))
    assert caches.expected("cloud", "a", 12_600) == pytest.approx(0.992 * 12_300, rel=1e-3)
    assert caches.expected("cloud", "b", 12_600) == 0  # another conversation: nothing of it was sent there
    assert caches.expected("cloud", "a", 5_000) == pytest.approx(0.992 * 5_000, rel=1e-3)  # at most the context
    assert caches.expected("cloud", None, 1_000) == pytest.approx(1_000 * caches.share("cloud"))  # no key: the share
    # A cloud whose reports never show a cached token (llama-cpp-python's server) is planned as holding nothing.
    disco.observe_usage("mute", Usage(9_000, 5), "c", 9_000)
    disco.observe_usage("mute", Usage(9_300, 5), "c", 9_300)
    assert caches.expected("mute", "c", 9_600) == 0
    # The key is the client's prompt_cache_key, else the one the gateway derived.
    assert conversation_key(GenerationRequest(prompt_text="p", cache_key="tandem-x")) == "tandem-x"
    own = GenerationRequest(prompt_text="p", cache_key=None, extras={"prompt_cache_key": "mine"})
    assert conversation_key(own) == "mine" and conversation_key(GenerationRequest(prompt_text="p")) is None


def test_the_accounting_tells_the_runtime_what_each_cloud_was_sent_for_its_conversation():
    disco = embedded_default()
    accounting = Accounting(disco, Ledger(None, disco.settings), Metrics())
    for turn, (context, cached) in enumerate(((12_000, 0), (12_300, 11_904))):
        job = agent_turn("agent", prompt=context)
        loser = Attempt("cloud", "cloud", 0.0, context, outcome="lost")  # a race's loser was sent it too
        won = Attempt("cloud", "cloud", 0.0, context, outcome="won", first_at=0.0, decode_tokens=3)
        won.usage = Usage(context, 3, cached_tokens=cached)
        job.attempts += [loser, won] if turn else [loser]
        accounting.book(job, 3, won.usage if turn else None)
    assert disco.estimators.prompt_caches.held("cloud", "agent", 20_000) == 12_300
    assert disco.estimators.prompt_caches.reliability("cloud") == pytest.approx(11_904 / 12_000)


def test_the_price_counts_only_what_each_endpoint_evaluates_or_is_billed_uncached():
    disco = embedded_default()
    cost = disco.cost("cloud")
    cold, warm = disco.outlook(PROMPT, "cloud"), disco.outlook(PROMPT, "cloud", device_cached=HELD)
    assert cold.device_prefill_cost == pytest.approx(cost.device_cost(PROMPT, 0))
    assert warm.device_prefill_cost == pytest.approx(cost.device_cost(200, 0))  # energy only for what it evaluates
    cloud_kept(disco, "agent")
    kept = disco.outlook(PROMPT, "cloud", conversation="agent")
    expected = (PROMPT - kept.cloud_cached) * 0.15 * M + kept.cloud_cached * 0.075 * M
    assert kept.cloud_prefill_cost == pytest.approx(expected) and kept.cloud_prefill_cost < cold.cloud_prefill_cost


def test_a_migration_onto_the_device_is_planned_with_its_cached_prefix_and_onto_the_cloud_with_its_conversations():
    disco = embedded_default()
    full = disco.check_migration("cloud", "device", "cloud", PROMPT, 100, 500, lead=0.0)
    cached = disco.check_migration("cloud", "device", "cloud", PROMPT, 100, 500, lead=0.0, cached_tokens=PROMPT)
    # t_m, and so the buffer B = r_c·t_m the client must be ahead by: the delivered 100 tokens after the held prompt,
    # not the whole context from scratch.
    assert full.buffer_tokens > 1000 > 30 > cached.buffer_tokens > 0
    device_price = disco.cost("cloud").device.prefill  # Eq. 5: the device's energy for the delivered tokens alone
    assert cached.overhead == pytest.approx(100 * device_price)
    assert full.overhead == pytest.approx(15_100 * device_price)
    cloud_kept(disco, "agent", PROMPT)
    other = disco.check_migration("device", "cloud", "cloud", PROMPT, 100, 500, lead=0.0, conversation="other")
    same = disco.check_migration("device", "cloud", "cloud", PROMPT, 100, 500, lead=0.0, conversation="agent")
    assert other.overhead == pytest.approx((PROMPT + 100) * 0.15 * M)
    assert same.overhead < 0.6 * other.overhead  # the conversation's prefix at the cached price


# -- scripted endpoints -----------------------------------------------------------------------------------------------


def endpoint(locality: str, cached_prefix=None) -> SimpleNamespace:
    return SimpleNamespace(
        locality=locality,
        structured_output="grammar",
        can_continue=True,
        accepts_token_ids=True,
        dialect=LLAMA_CPP,
        device_vocabulary=True,
        context_window=32_768,
        evaluations=0,
        cached_prefix=cached_prefix or (lambda ids: 0),
    )


def agent_turn(conversation: str, prompt: int = PROMPT) -> Job:
    gen = GenerationRequest(prompt_text="p", prompt_ids=tuple(range(prompt)), max_tokens=256, cache_key=conversation)
    return Job(id="t", gen=gen, prompt_tokens=prompt, policy="disco", cloud="cloud")
