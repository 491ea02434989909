"""A second Tandem as the continuing cloud, Tandem continuing a client's own start of the answer, and
`tandem check-cloud`'s verdicts.

Real parts: two gateways started with `tandem serve`. Tandem B serves SmolLM2-135M on its device (another tokenizer
than A's); Tandem A serves Qwen2.5-Coder-0.5B on its device and has B as its cloud twice, once per dialect B takes
(`prefix-flag`: Mistral's `"prefix": true`; `continue-final-message`: vLLM's flags), priced so that DiSCo moves
A's device-started answers onto it mid-answer. Both devices run in the reproducible mode, so B's part of a migrated
answer is compared with B's own answer to the same continuation, asked directly (one computation path).

A device fault: a third gateway (Qwen2.5-Coder-0.5B again) whose device stalls after its first token hands the answer
on to B in both of B's dialects and to llama.cpp's llama-server (conftest's `llama_server_smollm`, SmolLM2) in both of
its own (prefill, completions with SmolLM2's template); each cloud's part is compared with what it writes when asked
the same continuation directly (test_llama_server_dialects.py's helpers for llama-server).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.launcher import GatewayProcess, start_gateway, stop_gateway
from clients.chat_template import render_chat
from clients.gguf_meta import read_chat_template
from deploy.models import model_path
from tests.integration.disco_helpers import trace
from tests.integration.scripted_upstream import Answer
from tests.integration.test_llama_server_dialects import SMOLLM, direct

ROOT = Path(__file__).resolve().parents[2]

MESSAGES = [{"role": "user", "content": "Tell me a long story about a cat who learns to sail."}]
CHEAP = "{ prefill_per_million = 0.05, decode_per_million = 0.10 }"


@pytest.fixture(scope="module")
def tandem_b() -> Iterator[GatewayProcess]:
    process = start_gateway("""
[gateway]
policy = "device"
stall_timeout = 60     # a shared test machine: two llama.cpp models on the same cores
[device]
reproducible = true
model = "smollm2-135m-instruct"
n_ctx = 2048
[disco]
profile_device = false
""")
    yield process
    stop_gateway(process)


@pytest.fixture(scope="module")
def tandem_a(tandem_b: GatewayProcess) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
cloud = "prefixflag"
stall_timeout = 60     # a shared test machine: two llama.cpp models on the same cores
[device]
reproducible = true
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
consumption_rate = 0.2  # a slow reader: the move comes within a few tokens, however slow B's first token was
[clouds.prefixflag]
base_url = "{tandem_b.v1}"
model = "tandem"
continuation = "prefix-flag"
price = {CHEAP}
[clouds.cfm]
base_url = "{tandem_b.v1}"
model = "tandem"
continuation = "continue-final-message"
price = {CHEAP}
""")
    yield process
    stop_gateway(process)


def chat(gw: GatewayProcess, messages, max_tokens: int, **extra) -> httpx.Response:
    body = {"model": "tandem", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def content(r: httpx.Response) -> str:
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    ("cloud", "dialect", "flags"),
    [
        ("prefixflag", "prefix-flag", {"prefix": True}),
        ("cfm", "continue-final-message", {}),
    ],
)
def test_a_device_started_answer_moves_onto_a_second_tandem(tandem_a, tandem_b, cloud, dialect, flags):
    r = chat(tandem_a, MESSAGES, 24, tandem={"cloud": cloud})
    answer = content(r)
    t = trace(tandem_a, r.headers["x-request-id"])
    assert len(t["migrations"]) == 1, t
    (move,) = t["migrations"]
    assert (move["from"], move["to"], move["reason"], move["dialect"]) == ("device", cloud, "cost", dialect)
    outcomes = [(e["backend"], e["outcome"]) for e in t["endpoints"]]
    assert outcomes == [("device", "migrated-from"), (cloud, "finished")], t
    k = move["at_token"]
    delivered = content(_device(tandem_a, k))
    assert answer.startswith(delivered)
    seam = t["endpoints"][1]["seam"]
    assert seam["held"] == delivered[len(delivered.rstrip()) :]
    # B's part is B's own continuation of the delivered text (asked directly, in the same dialect), less the held
    # whitespace it wrote again: nothing doubled, nothing lost.
    extra = {"continue_final_message": True, "add_generation_prompt": False} if dialect.startswith("continue") else {}
    final = {"role": "assistant", "content": delivered.rstrip(), **flags}
    own = content(chat(tandem_b, [*MESSAGES, final], 24 - k, **extra))
    assert own.startswith(seam["dropped"])
    assert answer == delivered + own[len(seam["dropped"]) :]


def _device(gw: GatewayProcess, max_tokens: int) -> httpx.Response:
    body = {"model": "device", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


# --- a device fault: the answer goes on on the cloud, in its dialect ------------------------------------------------


@pytest.fixture(scope="module")
def stalling_a(tandem_b: GatewayProcess, llama_server_smollm) -> Iterator[GatewayProcess]:
    """Tandem A's device with a stall timeout of its own too short for any device: after its first token it has
    "stalled" (a device fault, test_privacy_routing's mechanism), while its clouds keep the gateway's patience. Its
    clouds: Tandem B in both of B's dialects, and llama-server (SmolLM2: another tokenizer) in both of its own."""
    process = start_gateway(f"""
[gateway]
policy = "device"
cloud = "prefixflag"
stall_timeout = 60     # a shared test machine: no cloud stalls here
[device]
reproducible = true
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
stall_timeout = 0.001  # no device writes tokens this fast
[disco]
profile_device = false
migration = false      # only the fault moves answers
[clouds.prefixflag]
base_url = "{tandem_b.v1}"
model = "tandem"
continuation = "prefix-flag"
[clouds.cfm]
base_url = "{tandem_b.v1}"
model = "tandem"
continuation = "continue-final-message"
[clouds.prefill]
base_url = "{llama_server_smollm.v1}"
model = "{SMOLLM}"
continuation = "prefill"
[clouds.templated]
base_url = "{llama_server_smollm.v1}"
model = "{SMOLLM}"
continuation = "completions"
template = "{SMOLLM}"
""")
    yield process
    stop_gateway(process)


@pytest.mark.parametrize(
    ("cloud", "dialect"),
    [
        ("prefixflag", "prefix-flag"),
        ("cfm", "continue-final-message"),
        ("prefill", "prefill"),
        ("templated", "completions"),
    ],
)
def test_a_device_that_stalls_mid_answer_hands_it_on_in_the_clouds_dialect(
    stalling_a, tandem_b, llama_server_smollm, cloud, dialect
):
    on_llama_server = dialect in ("prefill", "completions")
    max_tokens = 8
    r = chat(stalling_a, MESSAGES, max_tokens, stream=True, tandem={"cloud": cloud})
    answer, finish = streamed(r)
    t = trace(stalling_a, r.headers["x-request-id"])
    (move,) = t["migrations"]
    assert (move["from"], move["to"], move["reason"], move["dialect"]) == ("device", cloud, "stall", dialect), t
    assert [(e["backend"], e["outcome"]) for e in t["endpoints"]] == [("device", "failed"), (cloud, "finished")], t
    assert finish == "length" and "stalled" in t["endpoints"][0]["error"]
    k = move["at_token"]
    assert k >= 1
    # What the device delivered before it stalled: its own first k tokens (k is where it stalls, so a pinned request
    # for them ends before it could).
    delivered = content(_device(stalling_a, k))
    assert delivered and answer.startswith(delivered)
    seam = t["endpoints"][1]["seam"]
    assert seam["held"] == delivered[len(delivered.rstrip()) :]
    # The cloud's part is the cloud's own continuation of the delivered text, asked directly in the same dialect, less
    # the held whitespace it wrote again (and, from llama-server's prefill, the prefix it sent back): nothing
    # repeated, skipped or lost at the seam.
    if on_llama_server:
        own = direct(llama_server_smollm, dialect, delivered.rstrip(), max_tokens - k)
        if dialect == "prefill":
            assert own.startswith(delivered.rstrip()) and seam["echo_dropped"]
            own = own[len(delivered.rstrip()) :]
    else:
        flags = {"prefix": True} if dialect == "prefix-flag" else {}
        extra = {"continue_final_message": True, "add_generation_prompt": False} if dialect != "prefix-flag" else {}
        final = {"role": "assistant", "content": delivered.rstrip(), **flags}
        own = content(chat(tandem_b, [*MESSAGES, final], max_tokens - k, **extra))
    assert own.startswith(seam["dropped"])
    assert answer == delivered + own[len(seam["dropped"]) :]


def streamed(r: httpx.Response) -> tuple[str, str | None]:
    """A streamed answer's text and finish reason, from its SSE body."""
    text, finish = "", None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: ") :])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
    return text, finish


# --- Tandem continuing the client's own start (seams on a real model) ---------------------------------------------

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def continue_on_b(tandem_b, start: str, max_tokens: int = 8, **extra) -> str:
    return content(
        chat(tandem_b, [*QUESTION, {"role": "assistant", "content": start, "prefix": True}], max_tokens, **extra)
    )


def test_trailing_whitespace_of_a_prefill_is_not_doubled(tandem_b):
    spaced = continue_on_b(tandem_b, "The capital of France is ")
    bare = continue_on_b(tandem_b, "The capital of France is")
    assert bare.startswith(" ")  # what the model writes after the bare text: a word with its space
    assert spaced == bare[1:]  # the same answer, its space dropped: the client has it already
    assert "  " not in "The capital of France is " + spaced[:2]


def test_a_prefill_cut_inside_a_word_goes_on_inside_it(tandem_b):
    start = "The capital of France is Pa"
    answer = continue_on_b(tandem_b, start)
    # Exactly what the model writes after that text as a raw prompt (the same tokens: one computation path), so no
    # character is repeated or lost at the cut.
    prompt = render_chat(read_chat_template(model_path("smollm2-135m-instruct")), QUESTION) + start
    raw = httpx.post(
        tandem_b.v1 + "/completions",
        json={"model": "tandem", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert raw.status_code == 200, raw.text
    assert answer == raw.json()["choices"][0]["text"]


def test_a_prefill_ending_in_a_multi_byte_character(tandem_b):
    """The emoji is several byte tokens in SmolLM2's vocabulary: the answer goes on after the whole character."""
    answer = continue_on_b(tandem_b, "Le chat dit: miaou 🐱", max_tokens=6)
    assert answer and "\ufffd" not in answer


# --- tandem check-cloud ---------------------------------------------------------------------------------------------


def check_cloud(config: Path, name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "check-cloud", name, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


def test_check_cloud_says_what_each_upstream_does(tandem_b, upstream, tmp_path):
    upstream.reset()
    upstream.push(Answer(), Answer(status=400))  # answers a fresh request, refuses the continuation
    config = tmp_path / "clouds.toml"
    config.write_text(f"""
[gateway]
cloud = "prefixflag"
[device]
model = "smollm2-135m-instruct"
[clouds.prefixflag]
base_url = "{tandem_b.v1}"
model = "tandem"
continuation = "prefix-flag"
[clouds.cfm]
base_url = "{tandem_b.v1}"
model = "tandem"
continuation = "continue-final-message"
[clouds.history]        # to Tandem, a final assistant message without a flag is history: it starts again
base_url = "{tandem_b.v1}"
model = "tandem"
continuation = "prefill"
[clouds.refusing]
base_url = "{upstream.base_url}"
model = "scripted"
continuation = "prefill"
[clouds.embedded]       # the embedded stand-in: raw completions with the device's template
model = "qwen2.5-coder-0.5b-instruct"
tokenizer = "device"
continuation = "completions"
[clouds.embedded.embedded]
model = "qwen2.5-coder-0.5b-instruct"
port = 0
n_ctx = 1024
""")
    verdicts = {}
    for name in ("prefixflag", "cfm", "history", "refusing", "embedded"):
        done = check_cloud(config, name)
        line = next(ln for ln in done.stdout.splitlines() if "continuation:" in ln)
        verdicts[name] = (done.returncode, line.split()[1])
    assert verdicts == {
        "prefixflag": (0, "continued"),
        "cfm": (0, "continued"),
        "history": (1, "restarted"),
        "refusing": (1, "refused"),
        "embedded": (0, "continued"),
    }
    # The refused continuation went in the prefill dialect: the answer so far as a final assistant message.
    assert upstream.requests[-1].body["messages"][-1] == {"role": "assistant", "content": "1, 2, 3, 4, 5,"}
