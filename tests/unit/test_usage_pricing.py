"""Usage priced the way providers bill it: cached prompt tokens and reasoning tokens at their own prices.

Why these tests: a provider bills a prompt token read from its prompt cache at a fraction of the input price and
reports how many there were (`prompt_tokens_details.cached_tokens`), and reports reasoning tokens apart
(`completion_tokens_details.reasoning_tokens`). Booking everything at the input / output price over-counts spend,
and a migration cost model that prices a re-sent prefix at the full input price refuses moves that pay. Each test
pins one link of that chain: the upstream's usage read, the price list, the booking, the ledger, the migration rule.
"""

from __future__ import annotations

import json

import pytest

from app.serving.accounting import Accounting
from app.serving.budget import BudgetSettings, BudgetValidationError, Price, apply_patch
from app.serving.disco import DiscoRuntime
from app.serving.job import Attempt, Job
from app.serving.ledger import Ledger
from app.serving.metrics import Metrics
from app.serving.relay import Relay
from clients.base import BackendError, GenerationRequest, TokenEvent, Usage
from clients.openai_compat import OpenAICompatBackend, UpstreamOptions
from policies.cost import QWEN2_5_0_5B, DeviceEnergy, TokenPrices
from policies.migration import should_migrate

M = 1e-6  # one USD per million tokens, per token


# ------------------------------------------------------------------ prices


def test_cached_and_reasoning_tokens_cost_their_own_prices_and_default_to_input_and_output():
    plain = TokenPrices.per_million(2.0, 8.0)
    assert plain.cost(1000, 100, cached_tokens=600, reasoning_tokens=40) == pytest.approx(plain.cost(1000, 100))
    priced = TokenPrices.per_million(2.0, 8.0, cached=0.5, reasoning=10.0)
    expected = 400 * 2.0 * M + 600 * 0.5 * M + 60 * 8.0 * M + 40 * 10.0 * M
    assert priced.cost(1000, 100, cached_tokens=600, reasoning_tokens=40) == pytest.approx(expected)
    assert priced.scaled(2).cost(1000, 100, cached_tokens=600, reasoning_tokens=40) == pytest.approx(2 * expected)


def test_a_price_list_takes_cached_and_reasoning_prices_and_null_goes_back_to_following():
    settings = BudgetSettings(prices={"cloud": Price(2.0, 8.0)})
    assert settings.to_dict()["prices"]["cloud"] == {"prefill": 2.0, "decode": 8.0}  # unset: not shown, follows
    patched = apply_patch(settings, {"prices": {"cloud": {"cached": 0.5, "reasoning": 12}}})
    assert patched.prices["cloud"] == Price(2.0, 8.0, 0.5, 12.0)
    assert patched.to_dict()["prices"]["cloud"] == {"prefill": 2.0, "decode": 8.0, "cached": 0.5, "reasoning": 12.0}
    # a partial patch keeps the others; null unsets
    again = apply_patch(patched, {"prices": {"cloud": {"prefill": 3, "cached": None}}})
    assert again.prices["cloud"] == Price(3.0, 8.0, None, 12.0)
    assert again.cost_model("cloud", DeviceEnergy.from_arch(QWEN2_5_0_5B)).server.cached_prefill == pytest.approx(3 * M)
    with pytest.raises(BudgetValidationError) as info:
        apply_patch(settings, {"prices": {"cloud": {"cached": -1}}})
    assert info.value.field == "prices.cloud.cached"
    with pytest.raises(BudgetValidationError) as info:
        apply_patch(settings, {"prices": {"cloud": {"reasoning": "dear"}}})
    assert info.value.field == "prices.cloud.reasoning"
    with pytest.raises(BudgetValidationError) as info:
        apply_patch(settings, {"prices": {"cloud": {"prefill": None}}})
    assert info.value.field == "prices.cloud.prefill"


def test_the_config_names_the_cached_and_reasoning_prices(tmp_path):
    from app.config import load_settings

    path = tmp_path / "t.toml"
    path.write_text(
        "[clouds.cloud]\nprice = { prefill_per_million = 2.0, decode_per_million = 8.0, cached_per_million = 0.5 }\n"
    )
    ledger = Ledger.from_settings(load_settings(path))
    assert ledger.settings.prices["cloud"] == Price(2.0, 8.0, 0.5, None)


# ------------------------------------------------------------------ the upstream's usage


def backend() -> OpenAICompatBackend:
    return OpenAICompatBackend("cloud", UpstreamOptions(base_url="http://127.0.0.1:9/v1", model="m"))


def chunk(usage: dict) -> tuple[dict, bytes]:
    data = json.dumps({"choices": [], "usage": usage}).encode()
    return usage, data


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 10, "completion_tokens": 5}, Usage(10, 5)),
        (  # OpenAI's shape
            {
                "prompt_tokens": 1200,
                "completion_tokens": 300,
                "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 256, "audio_tokens": 0},
            },
            Usage(1200, 300, cached_tokens=1024, reasoning_tokens=256),
        ),
        (  # DeepSeek's cache counters
            {
                "prompt_tokens": 80,
                "completion_tokens": 9,
                "prompt_cache_hit_tokens": 64,
                "prompt_cache_miss_tokens": 16,
            },
            Usage(80, 9, cached_tokens=64),
        ),
        (  # details present but null (some servers): nothing cached
            {"prompt_tokens": 7, "completion_tokens": 2, "prompt_tokens_details": None},
            Usage(7, 2),
        ),
    ],
)
def test_an_upstreams_usage_is_read_with_the_parts_it_bills_apart(usage, expected):
    assert backend()._usage(*chunk(usage)) == expected


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 11}},
        {"prompt_tokens": 10, "completion_tokens": 5, "completion_tokens_details": {"reasoning_tokens": 6}},
        {"prompt_tokens": 10, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": "3"}},
        {"prompt_tokens": 10, "completion_tokens": 5, "completion_tokens_details": []},
        {"prompt_tokens": -1, "completion_tokens": 5},
    ],
)
def test_a_usage_that_does_not_add_up_is_an_upstream_fault(usage):
    with pytest.raises(BackendError, match="usage") as info:
        backend()._usage(*chunk(usage))
    assert info.value.status == 502


def test_reasoning_deltas_are_read_under_either_name():
    b = backend()
    for field in ("reasoning_content", "reasoning"):
        data = {"choices": [{"index": 0, "delta": {field: "hmm", "content": None}, "finish_reason": None}]}
        assert b._choices(data, b"")[0][4] == "hmm"
    with pytest.raises(BackendError, match="reasoning"):
        b._choices({"choices": [{"delta": {"reasoning_content": 3}}]}, b"")


# ------------------------------------------------------------------ the relay


def test_reasoning_passes_through_the_relay_and_is_counted_but_is_not_the_answer():
    relay = Relay(GenerationRequest(prompt_text="q", max_tokens=2, stop=("think",)), 0.0, 5.0)
    first = relay.feed(TokenEvent(text="", reasoning="I think"), 0.0)
    assert first.text == "" and first.reasoning == "I think" and first.finish_reason is None  # no stop in thinking
    assert relay.feed(TokenEvent(text="", reasoning=" so."), 0.0).reasoning == " so."
    assert relay.feed(TokenEvent(text="4"), 0.0).text == "4"
    last = relay.feed(TokenEvent(text="2"), 0.0)
    assert last.finish_reason == "length"  # the limit counts the answer's tokens only
    assert relay.reasoning_tokens == 2 and relay.produced == 2 and relay.prefix().text == "42"


# ------------------------------------------------------------------ booking


def runtime(price: Price) -> tuple[Accounting, Ledger, DiscoRuntime]:
    ledger = Ledger(None, BudgetSettings(prices={"cloud": price}))
    disco = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B)
    return Accounting(disco, ledger, Metrics()), ledger, disco


def job_with(*attempts: Attempt, prompt_tokens: int = 1000) -> Job:
    job = Job(
        id="j", gen=GenerationRequest(prompt_text="q"), prompt_tokens=prompt_tokens, policy="disco", cloud="cloud"
    )
    job.attempts += attempts
    return job


def test_a_cloud_that_reports_its_usage_is_booked_at_its_own_counts_and_prices():
    accounting, ledger, _ = runtime(Price(2.0, 8.0, cached=0.5, reasoning=10.0))
    cloud = Attempt("cloud", "cloud", 0.0, 1000, decode_tokens=60, reasoning_tokens=45, outcome="finished")
    # The provider counted the prompt with its own tokenizer (1010), read 768 of it from its cache, and 40 of its
    # 100 completion tokens were reasoning.
    cloud.usage = Usage(1010, 100, cached_tokens=768, reasoning_tokens=40)
    job = job_with(cloud)
    accounting.book(job, 60, cloud.usage)
    expected = (1010 - 768) * 2.0 * M + 768 * 0.5 * M + 60 * 8.0 * M + 40 * 10.0 * M
    assert job.cost == pytest.approx(expected)
    spend = ledger.snapshot()["spend"]["endpoints"]["cloud"]
    assert (spend["prefill_tokens"], spend["cached_tokens"]) == (1010, 768)
    assert (spend["decode_tokens"], spend["reasoning_tokens"]) == (100, 40)
    assert spend["cost_usd"] == pytest.approx(expected)
    # the client's usage: the request's prompt, the provider's parts
    assert job.usage == Usage(1000, 100, cached_tokens=768, reasoning_tokens=40)


def test_without_a_usage_report_reasoning_pieces_are_counted_and_booked_at_the_reasoning_price():
    accounting, ledger, _ = runtime(Price(2.0, 8.0, reasoning=20.0))
    cloud = Attempt("cloud", "cloud", 0.0, 1000, decode_tokens=10, reasoning_tokens=5, outcome="finished")
    job = job_with(cloud)
    accounting.book(job, 10, None)
    assert job.cost == pytest.approx(1000 * 2.0 * M + 10 * 8.0 * M + 5 * 20.0 * M)
    assert job.usage == Usage(1000, 15, reasoning_tokens=5)
    assert ledger.snapshot()["spend"]["endpoints"]["cloud"]["reasoning_tokens"] == 5


def test_the_prefix_a_continuation_resends_is_booked_as_that_clouds_input_and_cached_where_reported():
    """Device started, the answer moved to the cloud at token 50: the cloud is sent prompt + prefix again and bills
    it as input; what its provider read from its cache is booked at the cached price."""
    accounting, ledger, disco = runtime(Price(2.0, 8.0, cached=0.2))
    device = Attempt("device", "device", 0.0, 1000, decode_tokens=50, outcome="migrated-from")
    cloud = Attempt("cloud", "cloud", 0.0, 1050, migration=True, from_token=50, decode_tokens=30, outcome="finished")
    cloud.usage = Usage(1052, 30, cached_tokens=1024)
    job = job_with(device, cloud)
    accounting.book(job, 80, cloud.usage)
    cloud_part = (1052 - 1024) * 2.0 * M + 1024 * 0.2 * M + 30 * 8.0 * M
    assert job.cost == pytest.approx(cloud_part + disco.cost("cloud").device_cost(1000, 50))
    assert ledger.snapshot()["spend"]["endpoints"]["cloud"]["prefill_tokens"] == 1052
    # Not reported: the whole re-sent context at the input price.
    accounting, _, disco = runtime(Price(2.0, 8.0, cached=0.2))
    unreported = Attempt("cloud", "cloud", 0.0, 1050, migration=True, from_token=50, decode_tokens=30)
    job = job_with(Attempt("device", "device", 0.0, 1000, decode_tokens=50), unreported)
    accounting.book(job, 80, None)
    assert job.cost == pytest.approx(1050 * 2.0 * M + 30 * 8.0 * M + disco.cost("cloud").device_cost(1000, 50))


def test_the_ledger_refuses_parts_larger_than_their_wholes():
    ledger = Ledger(None, BudgetSettings(prices={"cloud": Price(1, 1)}))
    with pytest.raises(ValueError, match="cached_tokens"):
        ledger.record("r", "cloud", 10, 5, 0.0, constrained=True, cached_tokens=11)
    with pytest.raises(ValueError, match="reasoning_tokens"):
        ledger.record("r", "cloud", 10, 5, 0.0, constrained=True, reasoning_tokens=6)
    assert ledger.snapshot()["spend"]["requests"] == 0  # nothing half-booked


# ------------------------------------------------------------------ the migration rule


def test_a_resent_prefix_the_provider_caches_is_priced_at_the_cached_price_in_eq_5():
    common = dict(
        source="device",
        target="cloud",
        source_decode_price=10 * M,
        target_decode_price=1 * M,
        target_prefill_price=2 * M,
        prompt_tokens=2000,
        delivered_tokens=100,
        expected_remaining=400,  # saving 9e-6 * 400 = 3.6e-3
    )
    assert not should_migrate(**common).migrate  # the full re-prefill, 4.2e-3, costs more than it saves
    cached = should_migrate(**common, cached_tokens=1800, target_cached_price=0.2 * M)
    assert cached.overhead == pytest.approx(300 * 2 * M + 1800 * 0.2 * M) and cached.migrate


def test_disco_learns_a_clouds_cached_share_from_its_usage_reports_and_prices_a_move_with_it():
    _, _, disco = runtime(Price(2.0, 8.0, cached=0.1))

    def overhead() -> float:
        return disco.check_migration("device", "cloud", "cloud", 1000, 0, 100, lead=0.0).overhead

    assert overhead() == pytest.approx(1000 * 2.0 * M)  # nothing reported yet: the input price
    for _ in range(30):
        disco.observe_usage("cloud", Usage(1000, 10, cached_tokens=900))
    assert disco.estimators.cached_share("cloud") == pytest.approx(0.9)
    assert overhead() == pytest.approx(100 * 2.0 * M + 900 * 0.1 * M)
    # The device's own KV cache stays free: moving to the device is unaffected by the cloud's prompt cache.
    assert disco.check_migration("cloud", "device", "cloud", 1000, 0, 100, lead=0.0, cached_tokens=1000).overhead == 0
