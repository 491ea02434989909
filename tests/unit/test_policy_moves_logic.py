"""What each policy lets the orchestrator do mid-answer, on scripted endpoints (the orchestrator's own logic; the same
on the real models: tests/integration/test_policy_moves.py and test_quality_agents.py): the baselines never move an
answer for cost, DiSCo does; the quality policy escalates a device answer whose confidence falls below τ, and one that
writes again a tool call the conversation holds answered (under every policy that can reach the cloud: a fault),
onto the cloud from exactly the delivered prefix."""

from __future__ import annotations

import asyncio
import random

import pytest

from app.serving.budget import CONSUMPTION_RATE_RANGE, BudgetSettings, Price
from app.serving.disco import DiscoRuntime
from app.serving.job import Job
from app.serving.ledger import Ledger
from app.serving.metrics import Metrics
from app.serving.orchestrator import Orchestrator
from clients.base import GenerationRequest, TokenEvent
from clients.dialects import LLAMA_CPP
from policies.cost import QWEN2_5_0_5B
from policies.quality import TokenConfidence, call_key

WORDS = [f" w{i}" for i in range(24)]
CALL = ["<tool_call>", '\n{"name": "add", ', '"arguments": {"b": 2, "a": 1}}', "\n</tool_call>"]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


class Scripted:
    """An endpoint that writes `words` (token i is words[i], id i) and goes on from a delivered prefix of ids."""

    def __init__(self, name: str, locality: str, words: list[str], sure: list[float] | None = None) -> None:
        self.name, self.locality, self.model_id = name, locality, name
        self.words, self.sure = words, sure or [0.99] * len(words)
        self.structured_output, self.dialect = "grammar", LLAMA_CPP  # continues from token ids
        self.can_continue = self.accepts_token_ids = self.device_vocabulary = True
        self.context_window = 4096
        self.evaluations = 0
        self.requests: list[GenerationRequest] = []

    def cached_prefix(self, ids) -> int:
        return 0

    async def stream(self, gen: GenerationRequest):
        self.requests.append(gen)
        start = len(gen.prefix_ids or ())
        for i in range(start, len(self.words)):
            await asyncio.sleep(0)
            sure = TokenConfidence(self.sure[i], self.sure[i] / 2, 1.0) if gen.confidence else None
            last = i == len(self.words) - 1
            yield TokenEvent(self.words[i], token_id=i, confidence=sure, finish_reason="stop" if last else None)


def gateway(settings: BudgetSettings, device: Scripted, cloud: Scripted) -> Orchestrator:
    ledger = Ledger(None, settings)
    disco = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B, rng=random.Random(0))
    return Orchestrator({"device": device, "cloud": cloud}, "device", "cloud", True, Metrics(), disco, ledger)


def run(orchestrator: Orchestrator, policy: str, **job) -> tuple[Job, list]:
    gen = GenerationRequest(prompt_text="q", prompt_ids=(1, 2, 3), max_tokens=40, tools=job.pop("tools", ()))
    j = Job(id="j", gen=gen, prompt_tokens=3, policy=policy, cloud="cloud", **job)

    async def collect():
        return [d async for d in orchestrator.generate(j)]

    return j, asyncio.run(collect())


def moves(job: Job) -> list[tuple[str, str, str]]:
    return [(m["from"], m["to"], m["reason"]) for m in job.migrations]


def knobs(**kw) -> BudgetSettings:
    # A reader so slow that the migration buffer is full at once: a move that pays starts at the next token.
    return BudgetSettings(consumption_rate=CONSUMPTION_RATE_RANGE[0], **kw)


DEAR_CLOUD = {"exchange_rate": 0.0, "prices": {"cloud": Price(0.0, 1000.0)}}
DEAR_DEVICE = {"exchange_rate": 1e6, "prices": {"cloud": Price(0.0, 0.0)}}


@pytest.mark.parametrize(
    ("baseline", "budget", "prices", "start", "disco"),
    [
        ("server-only", 0.5, DEAR_CLOUD, "cloud", "disco-d"),
        ("cloud", 0.5, DEAR_CLOUD, "cloud", "disco-d"),
        ("stoch-s", 1.0, DEAR_CLOUD, "cloud", "disco-d"),
        ("device-only", 0.5, DEAR_DEVICE, "device", "disco-s"),
        ("device", 0.5, DEAR_DEVICE, "device", "disco-s"),
        ("stoch-d", 1.0, DEAR_DEVICE, "device", "disco-s"),
    ],
)
def test_baselines_move_only_on_a_fault_while_disco_moves_for_cost(baseline, budget, prices, start, disco):
    device, cloud = Scripted("device", "device", WORDS), Scripted("cloud", "cloud", WORDS)
    job, deltas = run(gateway(knobs(budget=budget, **prices), device, cloud), baseline)
    assert job.plan.start_cloud == (start == "cloud") and job.plan.start_device == (start == "device")
    assert moves(job) == [] and "".join(d.text for d in deltas) == "".join(WORDS)

    # The same prices under DiSCo with no budget for the constrained side: it starts there too, and moves.
    job, deltas = run(gateway(knobs(budget=0.0, **prices), device, cloud), disco)
    other = "device" if start == "cloud" else "cloud"
    assert moves(job) == [(start, other, "cost")]
    assert "".join(d.text for d in deltas) == "".join(WORDS)  # nothing repeated, skipped or lost


def test_the_quality_policy_escalates_when_the_device_falters():
    sure = [0.95] * 6 + [0.2] * 18  # the mean over the tokens so far drops below 0.6 at the 12th
    device, cloud = Scripted("device", "device", WORDS, sure), Scripted("cloud", "cloud", WORDS)
    # Moving never pays for cost; DiSCo-S with no server budget starts on the device.
    equal = {"exchange_rate": 0.0, "prices": {"cloud": Price(0.0, 0.0)}, "constrained_side": "server"}
    job, deltas = run(gateway(knobs(budget=0.0, quality_threshold=0.6, **equal), device, cloud), "quality")
    assert moves(job) == [("device", "cloud", "quality")]
    k = job.migrations[0]["at_token"]
    assert k == 12
    window = sure[max(0, k - 16) : k]
    assert sum(window) / len(window) < 0.6 <= sum(sure[: k - 1]) / (k - 1)  # the first token where the mean fell
    assert cloud.requests[-1].prefix_ids == tuple(range(k))
    assert "".join(d.text for d in deltas) == "".join(WORDS)
    assert device.requests[0].confidence and not cloud.requests[-1].confidence

    # Under DiSCo, or with the request's own τ = 0, the same answer stays on the device.
    for policy, tau in (("disco", None), ("quality", 0.0)):
        device.requests.clear()
        job, _ = run(gateway(knobs(budget=0.0, **equal), device, cloud), policy, quality_threshold=tau)
        assert moves(job) == [] and job.attempts[-1].name == "device"


def test_a_repeated_tool_call_goes_to_the_cloud_undelivered():
    device = Scripted("device", "device", CALL)
    cloud = Scripted("cloud", "cloud", [" The", " sum", " is", " 3."])
    answered = (call_key("add", '{"a": 1, "b": 2}'),)
    equal = {"exchange_rate": 0.0, "prices": {"cloud": Price(0.0, 0.0)}, "constrained_side": "server"}
    o = gateway(knobs(budget=0.0, **equal), device, cloud)
    for policy in ("quality", "disco"):  # a fault under every policy that can reach the cloud
        job, deltas = run(o, policy, tools=(ADD,), answered_calls=answered)
        assert moves(job) == [("device", "cloud", "loop")] and job.migrations[0]["at_token"] == 0, policy
        assert not any(d.tool_calls for d in deltas)
        assert "".join(d.text for d in deltas) == " The sum is 3."
        assert [(a.name, a.outcome) for a in job.attempts] == [("device", "migrated-from"), ("cloud", "finished")]

    # A call not yet answered, or the same one under device-only, is delivered as the device wrote it.
    for policy, calls in (("quality", (call_key("add", {"a": 2, "b": 2}),)), ("device-only", answered)):
        job, deltas = run(o, policy, tools=(ADD,), answered_calls=calls)
        assert moves(job) == []
        (call,) = [c for d in deltas for c in d.tool_calls]
        assert call_key(call.name, call.arguments) == answered[0]


def test_a_conversation_already_looping_starts_on_the_cloud():
    device, cloud = Scripted("device", "device", WORDS), Scripted("cloud", "cloud", WORDS)
    twice = (call_key("add", {"a": 1, "b": 2}),) * 2
    o = gateway(knobs(budget=0.0, constrained_side="server"), device, cloud)  # DiSCo alone: the device
    for policy in ("quality", "disco"):
        job, _ = run(o, policy, tools=(ADD,), answered_calls=twice)
        assert job.plan.start_cloud and not job.plan.start_device and "loop" in job.plan.reason, policy
    job, _ = run(o, "disco", tools=(ADD,), answered_calls=twice[:1])  # answered once: DiSCo's own plan
    assert not job.plan.start_cloud
    job, _ = run(o, "stoch-d", tools=(ADD,), answered_calls=twice)  # a baseline's plan is the experiment
    assert "loop" not in job.plan.reason


def test_a_co_located_cloud_is_planned_without_a_race():
    ledger = Ledger(None, BudgetSettings(policy="disco-s", budget=1.0, prices={"cloud": Price(0.15, 0.6)}))
    apart = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B)
    together = DiscoRuntime(ledger, "cloud", QWEN2_5_0_5B, co_located=frozenset({"cloud"}))
    assert apart.plan("disco-s", 200, "cloud").race
    plan = together.plan("disco-s", 200, "cloud")
    assert plan.start_device and not plan.start_cloud
    for _ in range(40):  # the cloud's TTFT, measured: far below the device's predicted one for a long prompt
        together.observe_first_token("cloud", "cloud", 200, 0.01, migration=False)
    plan = together.plan("disco-s", 4000, "cloud")
    assert plan.start_cloud and not plan.start_device
