"""Context windows per endpoint, the pure rules (on the real models and servers: test_context_windows.py): where a
cloud's window comes from, which endpoints a prompt must fit, the planner never starting, racing or moving an answer
onto an endpoint that cannot hold it with one token more, and max_tokens clamped to what the window of the endpoint
writing the answer leaves, on scripted endpoints."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from app.config import ConfigError, Settings, load_settings
from app.serving.budget import BudgetSettings, Price
from app.serving.disco import DiscoRuntime
from app.serving.errors import InvalidRequest
from app.serving.job import Attempt, Job
from app.serving.ledger import Ledger
from app.serving.metrics import Metrics
from app.serving.orchestrator import Orchestrator
from app.serving.relay import Relay
from app.serving.windows import check_fits, largest_window, starts_on
from clients.base import GenerationRequest, TokenEvent
from clients.dialects import LLAMA_CPP
from clients.openai_compat import DEFAULT_CONTEXT_WINDOW, OpenAICompatBackend, UpstreamOptions, reported_window
from policies.cost import QWEN2_5_0_5B
from policies.dispatch import DispatchPlan

# -- where a cloud's window comes from ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "window"),
    [
        ({"data": [{"id": "m", "max_model_len": 32768}]}, 32768),  # vLLM
        ({"data": [{"id": "m", "context_length": 131072}]}, 131072),  # OpenRouter, Tandem
        ({"data": [{"id": "m", "max_context_length": 65536}]}, 65536),  # Mistral
        ({"data": [{"id": "m", "meta": {"n_ctx": 8192, "n_ctx_train": 32768}}]}, 8192),  # llama-server: a slot's
        ({"data": [{"id": "other", "meta": {"n_ctx_train": 4096}}]}, 4096),  # the only model, by another name
        ({"data": [{"id": "a", "max_model_len": 1}, {"id": "m", "max_model_len": 2048}]}, 2048),  # by its id
        ({"data": [{"id": "a", "max_model_len": 1}, {"id": "b", "max_model_len": 2}]}, None),  # not listed
        ({"data": [{"id": "m", "owned_by": "me"}]}, None),  # llama-cpp-python's server says nothing
        ({"data": [{"id": "m", "context_length": True}]}, None),
        ({"object": "list"}, None),
        ([], None),
    ],
)
def test_a_window_is_read_from_what_the_servers_report(body, window):
    assert reported_window(body, "m") == window


def test_a_clouds_window_comes_from_its_entry_its_preset_or_its_embedded_server(tmp_path):
    def window(**cloud) -> int | None:
        return Settings(clouds={"c": {"model": "m", **cloud}}, gateway={"cloud": "c"}).clouds["c"].window

    assert window() is None  # read from its /v1/models at start-up
    assert window(context_length=50_000) == 50_000
    assert window(provider="anthropic-openai") == 200_000
    assert window(provider="openai", context_length=1_000_000) == 1_000_000  # the entry wins over its preset
    assert window(provider="vllm") is None  # vLLM reports max_model_len
    assert window(embedded={"n_ctx": 8192}) == 8192
    assert window(embedded={"n_ctx": 8192}, context_length=4096) == 4096
    path = tmp_path / "c.toml"
    path.write_text('[gateway]\ncloud = "c"\n[clouds.c]\ncontext_length = 9000\n[clouds.c.embedded]\nn_ctx = 8192\n')
    with pytest.raises(ConfigError, match=r"clouds\.c.*context_length \(9000\) is more than the embedded server holds"):
        load_settings(path)


def test_an_upstream_without_a_window_in_its_settings_takes_the_default_until_its_models_say():
    backend = OpenAICompatBackend("c", UpstreamOptions("http://127.0.0.1:9/v1", "m"))
    assert backend.context_window == DEFAULT_CONTEXT_WINDOW
    assert OpenAICompatBackend("c", UpstreamOptions("http://127.0.0.1:9/v1", "m", context_window=7)).context_window == 7


# -- which endpoints a prompt must fit --------------------------------------------------------------------------------


def endpoint(locality: str, window: int, continues: bool = True):
    return SimpleNamespace(
        locality=locality,
        structured_output="grammar",
        can_continue=continues,
        accepts_token_ids=True,
        dialect=LLAMA_CPP,
        device_vocabulary=True,
        context_window=window,
        evaluations=0,
    )


WINDOWS = {"device": endpoint("device", 1024), "cloud": endpoint("cloud", 8192), "hat": endpoint("split", 4096)}


@pytest.mark.parametrize(
    ("route", "names"),
    [
        ((None, "disco", "cloud", "any"), ["device", "cloud"]),
        ((None, "quality", "hat", "any"), ["device", "hat"]),
        ((None, "device-only", "cloud", "any"), ["device"]),
        ((None, "server-only", "cloud", "any"), ["cloud"]),
        ((None, "disco", "cloud", "device"), ["device"]),  # the privacy level keeps it off the cloud
        (("cloud", "device-only", "cloud", "any"), ["cloud"]),  # a model that names an endpoint
    ],
)
def test_a_request_starts_on_the_endpoints_its_model_policy_and_privacy_allow(route, names):
    assert starts_on(WINDOWS, "device", *route) == names


def test_a_prompt_fits_when_one_endpoint_it_may_start_on_holds_it_and_one_token_more():
    check_fits(WINDOWS, "device", (None, "disco", "cloud", "any"), 8191)  # the cloud holds it
    with pytest.raises(InvalidRequest) as refused:
        check_fits(WINDOWS, "device", (None, "disco", "cloud", "any"), 8192)  # no room left for the answer
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert "8192 tokens, more than the context window of 8192 tokens of cloud, the largest" in str(refused.value)
    with pytest.raises(InvalidRequest, match="1024 tokens of device, the endpoint its model names"):
        check_fits(WINDOWS, "device", ("device", "disco", "cloud", "any"), 2000)
    with pytest.raises(
        InvalidRequest, match="1024 tokens of device, the one endpoint its routing policy 'device-only' answers on"
    ):
        check_fits(WINDOWS, "device", (None, "device-only", "cloud", "any"), 2000)
    with pytest.raises(InvalidRequest, match="of device"):
        check_fits(WINDOWS, "device", (None, "disco", "cloud", "device"), 2000)
    check_fits(WINDOWS, "device", ("cloud", "disco", "cloud", "any"), 2000)
    check_fits(WINDOWS, "device", (None, "server-only", "cloud", "device"), 10**6)  # no endpoint: refused elsewhere
    assert largest_window(WINDOWS, ["device", "hat"]) == 4096


# -- the planner: starts, races, fallbacks and moves -----------------------------------------------------------------


@pytest.fixture
def orchestrator() -> Orchestrator:
    return Orchestrator(WINDOWS, "device", "cloud", True, Metrics(), disco=None, ledger=None)


def job(prompt_tokens: int, max_tokens: int = 256, cloud: str = "cloud") -> Job:
    gen = GenerationRequest(prompt_text="p", max_tokens=max_tokens)
    return Job(id="t", gen=gen, prompt_tokens=prompt_tokens, policy="disco", cloud=cloud)


def delivered(j: Job, name: str, tokens: int) -> Attempt:
    """`name` wrote the answer's first `tokens` tokens."""
    attempt = Attempt("device" if name == "device" else "cloud", name, 0.0, j.prompt_tokens, first_at=0.0)
    attempt.decode_tokens = tokens
    j.attempts.append(attempt)
    return attempt


def test_an_endpoint_serves_a_prompt_only_with_room_for_one_token_more(orchestrator):
    assert orchestrator._serves(job(1023), "device") and not orchestrator._serves(job(1024), "device")
    assert orchestrator._serves(job(1024), "cloud")


def test_no_answer_moves_onto_an_endpoint_that_cannot_hold_the_prompt_and_the_delivered_prefix(orchestrator):
    j = job(1000)
    source = delivered(j, "cloud", 23)  # 1000 + 23 + 1 fits the device's 1024
    assert orchestrator._fault_targets(j, source) == ["device", "hat"]
    source.decode_tokens = 24  # one more delivered token: the device can no longer hold it and write one more
    assert orchestrator._fault_targets(j, source) == ["hat"]
    assert not orchestrator._serves(j, "device", continuing=True) and orchestrator._serves(j, "device")
    source.decode_tokens = 3100  # nor the split model
    assert orchestrator._fault_targets(j, source) == []


def test_the_plan_starts_only_the_endpoint_of_the_pair_that_holds_the_prompt(orchestrator):
    race = DispatchPlan(True, True, 0.0, "disco-s", "long prompt")
    on_device = DispatchPlan(False, True, None, "disco-s", "short prompt")
    moved = orchestrator._within_windows(job(2000), on_device)
    assert (moved.start_cloud, moved.start_device) == (True, False)
    assert moved.reason == "the prompt's 2000 tokens leave no room in device's 1024-token window"
    moved = orchestrator._within_windows(job(2000), race)
    assert (moved.start_cloud, moved.start_device) == (True, False)
    assert orchestrator._within_windows(job(500), race) is race
    assert orchestrator._within_windows(job(9000), on_device) is on_device  # neither holds it: the core refused it


def test_max_tokens_is_clamped_to_the_window_left_and_again_on_a_smaller_window(orchestrator):
    j = job(1000, max_tokens=32_000)
    orchestrator._clamp(j, "cloud")
    assert j.gen.max_tokens == 7192 and j.max_tokens_clamped == {"asked": 32_000, "given": 7192, "endpoint": "cloud"}
    orchestrator._clamp(j, "device")  # the answer moved onto the device
    assert j.gen.max_tokens == 24 and j.max_tokens_clamped == {"asked": 32_000, "given": 24, "endpoint": "device"}
    orchestrator._clamp(j, "cloud")  # a larger window never gives back what the client was told
    assert j.gen.max_tokens == 24
    short = job(10, max_tokens=100)
    orchestrator._clamp(short, "device")
    assert short.gen.max_tokens == 100 and short.max_tokens_clamped is None


def test_the_relays_limit_only_comes_down():
    relay = Relay(GenerationRequest(prompt_text="p", max_tokens=5), 0.0, 1000.0)
    relay.limit_to(3)
    relay.limit_to(9)
    finishes = [relay.feed(TokenEvent(f" t{i}", token_id=i), 0.0).finish_reason for i in range(3)]
    assert finishes == [None, None, "length"]


# -- one answer through the orchestrator, on scripted endpoints ------------------------------------------------------


class Scripted:
    """Writes token i as ` w{i}` (id i) up to its own max_tokens, continuing from a delivered prefix of ids; asks of
    each request what it was sent."""

    def __init__(self, name: str, locality: str, window: int, fail_after: int | None = None) -> None:
        self.name, self.locality, self.model_id, self.context_window = name, locality, name, window
        self.structured_output, self.dialect = "grammar", LLAMA_CPP
        self.can_continue = self.accepts_token_ids = self.device_vocabulary = True
        self.evaluations = 0
        self.fail_after = fail_after
        self.requests: list[GenerationRequest] = []

    def cached_prefix(self, ids) -> int:
        return 0

    async def stream(self, gen: GenerationRequest):
        self.requests.append(gen)
        start = len(gen.prefix_ids or ())
        for i in range(start, start + gen.max_tokens):
            await asyncio.sleep(0)
            if self.fail_after is not None and i >= self.fail_after:
                raise ConnectionError(f"{self.name} went away")
            last = i == start + gen.max_tokens - 1
            yield TokenEvent(f" w{i}", token_id=i, finish_reason="length" if last else None)


def answer(device: Scripted, cloud: Scripted, policy: str, prompt_tokens: int, max_tokens: int) -> tuple[Job, list]:
    ledger = Ledger(None, BudgetSettings(prices={"cloud": Price(0.15, 0.6)}))
    disco = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B, rng=random.Random(0))
    orchestrator = Orchestrator({"device": device, "cloud": cloud}, "device", "cloud", True, Metrics(), disco, ledger)
    gen = GenerationRequest(prompt_text="q", prompt_ids=tuple(range(prompt_tokens)), max_tokens=max_tokens)
    j = Job(id="j", gen=gen, prompt_tokens=prompt_tokens, policy=policy, cloud="cloud")

    async def collect():
        return [d async for d in orchestrator.generate(j)]

    return j, asyncio.run(collect())


@pytest.mark.parametrize("policy", ["stoch-s", "disco"])  # seeded: drawn for the device; a race
def test_a_prompt_the_device_cannot_hold_is_answered_by_the_cloud_where_the_plan_said_device_too(policy):
    device, cloud = Scripted("device", "device", 64), Scripted("cloud", "cloud", 4096)
    j, deltas = answer(device, cloud, policy, prompt_tokens=100, max_tokens=8)
    assert not device.requests and len(cloud.requests) == 1
    assert j.backend == "cloud" and j.plan.start_cloud and not j.plan.start_device
    assert j.plan.reason == "the prompt's 100 tokens leave no room in device's 64-token window"
    assert "".join(d.text for d in deltas) == "".join(f" w{i}" for i in range(8))


def test_an_answer_is_clamped_on_the_device_and_the_relay_ends_it_there():
    device, cloud = Scripted("device", "device", 40), Scripted("cloud", "cloud", 4096)
    j, deltas = answer(device, cloud, "device-only", prompt_tokens=30, max_tokens=32_000)
    assert device.requests[0].max_tokens == 10  # 40 - 30
    assert j.max_tokens_clamped == {"asked": 32_000, "given": 10, "endpoint": "device"}
    assert "".join(d.text for d in deltas) == "".join(f" w{i}" for i in range(10))
    assert deltas[-1].finish_reason == "length"


def test_a_fault_moves_the_answer_onto_the_device_only_while_its_window_still_holds_it():
    # The cloud fails after 5 tokens: 30 + 5 + 1 fits the device's 40, and the device writes on up to its window.
    device, cloud = Scripted("device", "device", 40), Scripted("cloud", "cloud", 4096, fail_after=5)
    j, deltas = answer(device, cloud, "server-only", prompt_tokens=30, max_tokens=32_000)
    assert [(m["from"], m["to"], m["reason"]) for m in j.migrations] == [("cloud", "device", "error")]
    assert device.requests[0].max_tokens == 5  # 40 - 30 - 5: the relay's limit came down with it
    assert j.max_tokens_clamped == {"asked": 32_000, "given": 10, "endpoint": "device"}
    assert "".join(d.text for d in deltas) == "".join(f" w{i}" for i in range(10))
    assert deltas[-1].finish_reason == "length"
    # After 10 tokens the device could not hold it (30 + 10 + 1 > 40): the answer fails rather than overflow it.
    device, cloud = Scripted("device", "device", 40), Scripted("cloud", "cloud", 4096, fail_after=10)
    with pytest.raises(Exception, match="went away"):
        answer(device, cloud, "server-only", prompt_tokens=30, max_tokens=32_000)
    assert not device.requests


def test_the_embedded_server_gets_its_window_and_what_a_long_one_needs():
    from itertools import pairwise
    from pathlib import Path

    from app.config import EmbeddedServerSettings, embedded_default
    from app.embedded import EmbeddedServer

    def flags(settings: EmbeddedServerSettings) -> dict[str, str]:
        command = EmbeddedServer(settings, Path("m.gguf"), "m").command()
        return {name: value for name, value in pairwise(command) if name.startswith("--")}

    assert flags(EmbeddedServerSettings(port=9))["--logits_all"] == "True"  # the server's own default
    shipped = load_settings(embedded_default())
    cloud = flags(shipped.clouds["cloud"].embedded)
    # The embedded default: both bundled models at the 32,768 tokens they were trained for, and the cloud without
    # an n_ctx x vocabulary array of logits (~20 GB at that window) and with flash attention's small buffers.
    assert (cloud["--n_ctx"], cloud["--logits_all"], cloud["--flash_attn"]) == ("32768", "False", "True")
    assert shipped.device.n_ctx == shipped.clouds["cloud"].window == 32_768


def test_an_upstream_that_computes_no_logprobs_is_not_asked_for_them():
    from clients.base import BackendError

    backend = OpenAICompatBackend("c", UpstreamOptions("http://127.0.0.1:9/v1", "m", logprobs=False))

    async def first(gen: GenerationRequest):
        return await anext(backend.stream(gen))

    with pytest.raises(BackendError, match="computes no logprobs") as refused:  # before anything is sent
        asyncio.run(first(GenerationRequest(prompt_text="p", messages=({"role": "user", "content": "p"},), logprobs=2)))
    assert refused.value.status == 501
