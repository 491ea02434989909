"""Which endpoints a request may use, asked in one place (`Orchestrator._serves`) by starts, races, fallbacks and
migrations: privacy levels and structured output, on stub endpoints (pure routing logic; the real-model paths are in
tests/integration/test_privacy_routing.py and test_tools_structured.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from app.serving.job import Attempt, Job
from app.serving.metrics import Metrics
from app.serving.orchestrator import Orchestrator
from clients.base import GenerationRequest
from clients.dialects import upstream_dialect


def endpoint(locality: str, structured: str, continues: bool = True, ids: bool = True):
    return SimpleNamespace(
        locality=locality,
        structured_output=structured,
        can_continue=continues,
        accepts_token_ids=ids,
        dialect=upstream_dialect(None, "completions" if continues else "chat"),
        device_vocabulary=ids,
        context_window=4096,
    )


BACKENDS = {
    "device": endpoint("device", "grammar"),
    "hat": endpoint("split", "grammar"),
    "raw": endpoint("cloud", "none"),  # a completions cloud
    "chat": endpoint("cloud", "native", continues=False, ids=False),
}


@pytest.fixture(scope="module")
def orchestrator() -> Orchestrator:
    return Orchestrator(BACKENDS, "device", "raw", True, Metrics(), disco=None, ledger=None)


def job(privacy: str = "any", grammar: str | None = None, tools=(), cloud: str = "raw", gbnf: str | None = None) -> Job:
    gen = GenerationRequest(prompt_text="hi", grammar=grammar, tools=tools, gbnf=gbnf)
    return Job(id="t", gen=gen, prompt_tokens=1, policy="disco", cloud=cloud, privacy=privacy)


def attempt(name: str, role: str = "device") -> Attempt:
    return Attempt(role, name, 0.0, 1)


@pytest.mark.parametrize(
    ("privacy", "targets"),
    [("device", []), ("split", ["hat"]), ("any", ["raw", "hat"])],  # the pair first, then the others
)
def test_a_device_fault_goes_only_where_the_level_allows(orchestrator, privacy, targets):
    assert orchestrator._fault_targets(job(privacy), attempt("device")) == targets


def test_a_grammar_continues_only_where_it_is_followed_from_a_prefix(orchestrator):
    j = job(grammar='start: "x"')
    assert orchestrator._fault_targets(j, attempt("device")) == ["hat"]
    assert [n for n in BACKENDS if orchestrator._serves(j, n)] == ["device", "hat", "chat"]  # fresh starts
    assert [n for n in BACKENDS if orchestrator._serves(j, n, continuing=True)] == ["device", "hat"]
    # A grammar naming the device's special tokens needs the device's vocabulary.
    tagged = job(grammar="start: <[151657]>")
    BACKENDS["hat"].accepts_token_ids = False
    try:
        assert not orchestrator._serves(tagged, "hat")
    finally:
        BACKENDS["hat"].accepts_token_ids = True


def test_privacy_and_structure_combine(orchestrator):
    j = job(privacy="split", grammar='start: "x"')
    assert [n for n in BACKENDS if orchestrator._serves(j, n)] == ["device", "hat"]
    j = job(privacy="device", tools=({"type": "function", "function": {"name": "f"}},))
    assert [n for n in BACKENDS if orchestrator._serves(j, n)] == ["device"]


def test_failed_endpoints_are_not_tried_again(orchestrator):
    j = job()
    failed = attempt("raw", "cloud")
    failed.outcome = "failed"
    j.attempts.append(failed)
    assert orchestrator._fault_targets(j, attempt("device")) == ["hat"]


def test_a_started_call_comes_out_whole_only_where_the_tool_grammar_applies_or_the_upstream_takes_tools(orchestrator):
    """tool_choice auto (a lazy tool grammar): an answer starts, and cost-migrates, where a call is kept whole."""
    weather = ({"type": "function", "function": {"name": "f"}},)
    auto = Job(
        id="t",
        gen=GenerationRequest(prompt_text="hi", tools=weather, tool_grammar="start: <[151657]>"),
        prompt_tokens=1,
        policy="disco",
        cloud="raw",
    )
    keeps = [n for n in BACKENDS if orchestrator._keeps_calls_whole(auto, n)]
    assert keeps == ["device", "hat", "chat"]  # not the completions cloud, which gets the tools as prompt text
    assert not orchestrator._keeps_calls_whole(auto, "chat", continuing=True)  # a chat upstream starts answers only
    BACKENDS["hat"].accepts_token_ids = False  # the grammar's special tokens are the device vocabulary's
    try:
        assert not orchestrator._keeps_calls_whole(auto, "hat")
    finally:
        BACKENDS["hat"].accepts_token_ids = True
    assert all(orchestrator._keeps_calls_whole(job(tools=weather), n) for n in BACKENDS)  # no tool grammar: anywhere


def test_an_upstream_that_takes_gbnf_serves_a_grammar_that_has_a_gbnf_form(orchestrator):
    BACKENDS["gbnf"] = endpoint("cloud", "gbnf", ids=False)
    try:
        # The device's tag tokens in the llguidance grammar do not matter there: the GBNF spells the tags out.
        with_gbnf = job(grammar="start: <[151657]>", gbnf='root ::= "x"')
        assert orchestrator._serves(with_gbnf, "gbnf") and orchestrator._serves(with_gbnf, "gbnf", continuing=True)
        assert "gbnf" in orchestrator._fault_targets(with_gbnf, attempt("device"))
        assert not orchestrator._serves(job(grammar='start: "x"'), "gbnf")  # no GBNF form: not there
    finally:
        del BACKENDS["gbnf"]
