"""A device-started answer moves mid-answer onto llama.cpp's own `llama-server`, a model with another tokenizer.

Real parts: the gateway (`tandem serve`, Qwen2.5-Coder-0.5B on its device, reproducible) and llama-server built by
the set-up, serving SmolLM2-135M (tests/conftest.py's `llama_server_smollm`). The same server is configured twice:
`continuation = "prefill"` (llama-server continues a final assistant message) and `continuation = "completions"`
with SmolLM2's own chat template (raw /v1/completions, the template applied by the gateway). The cloud's part of
each migrated answer is compared with what llama-server writes when asked the same continuation directly, along the
same computation path (the fixture's llama-server evaluates every request afresh): nothing doubled, nothing lost. And
`tandem check-cloud` says llama-server continues in both dialects (the `llama-server` preset: prefill), and that one
started with `--no-prefill-assistant` restarts.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app import check_cloud
from app.config import load_settings
from app.launcher import GatewayProcess, start_gateway, start_llama_server, stop_gateway, stop_server
from clients.chat_template import render_chat
from clients.gguf_meta import read_chat_template
from deploy.models import model_path
from tests.integration.disco_helpers import trace

MESSAGES = [{"role": "user", "content": "Tell me a long story about a cat who learns to sail."}]
CHEAP = "{ prefill_per_million = 0.05, decode_per_million = 0.10 }"
SMOLLM = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def gw(llama_server_smollm) -> Iterator[GatewayProcess]:
    process = start_gateway(f"""
[gateway]
policy = "disco-s"     # DiSCo-S with no server budget: answers start on the device and move when that pays
cloud = "prefill"
stall_timeout = 60     # a shared test machine: never a fault here
[device]
reproducible = true
model = "qwen2.5-coder-0.5b-instruct"
n_ctx = 2048
[disco]
profile_device = false
budget = 0
consumption_rate = 0.2  # a slow reader: the move comes within a few tokens
[clouds.prefill]
base_url = "{llama_server_smollm.v1}"
model = "{SMOLLM}"
continuation = "prefill"
price = {CHEAP}
[clouds.templated]
base_url = "{llama_server_smollm.v1}"
model = "{SMOLLM}"
continuation = "completions"
template = "{SMOLLM}"
price = {CHEAP}
""")
    yield process
    stop_gateway(process)


def direct(server, dialect: str, delivered: str, max_tokens: int) -> str:
    """What llama-server writes after `delivered` when asked in `dialect` itself: the very input a migration onto it
    sends, evaluated as that was (conftest's `llama_server_smollm` reuses nothing of an earlier request)."""
    if dialect == "prefill":
        body = {
            "model": SMOLLM,
            "messages": [*MESSAGES, {"role": "assistant", "content": delivered}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        r = httpx.post(server.v1 + "/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]
    prompt = render_chat(read_chat_template(model_path(SMOLLM)), MESSAGES) + delivered
    body = {"model": SMOLLM, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize(("cloud", "dialect"), [("prefill", "prefill"), ("templated", "completions")])
def test_a_device_started_answer_moves_onto_llama_server(gw, llama_server_smollm, cloud, dialect):
    body = {"model": "tandem", "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "tandem": {"cloud": cloud}}
    r = httpx.post(gw.v1 + "/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    t = trace(gw, r.headers["x-request-id"])
    assert len(t["migrations"]) == 1, t
    (move,) = t["migrations"]
    assert (move["from"], move["to"], move["reason"], move["dialect"]) == ("device", cloud, "cost", dialect)
    k = move["at_token"]
    mine = {"model": "device", "messages": MESSAGES, "max_tokens": k, "temperature": 0}
    delivered = httpx.post(gw.v1 + "/chat/completions", json=mine, timeout=120).json()["choices"][0]["message"]
    delivered = delivered["content"]
    assert answer.startswith(delivered)
    seam = t["endpoints"][1]["seam"]
    assert seam["held"] == delivered[len(delivered.rstrip()) :]
    own = direct(llama_server_smollm, dialect, delivered.rstrip(), 24 - k)
    if dialect == "prefill":  # llama-server sends the prefilled message back whole; the seam dropped that part
        assert own.startswith(delivered.rstrip()) and seam["echo_dropped"]
        own = own[len(delivered.rstrip()) :]
    assert own.startswith(seam["dropped"])
    assert answer == delivered + own[len(seam["dropped"]) :]
    assert not answer[len(delivered) :].startswith(delivered.rstrip())  # the delivered text is not written twice


def test_check_cloud_says_llama_server_continues_in_both_dialects(llama_server_smollm, tmp_path):
    config = tmp_path / "clouds.toml"
    config.write_text(f"""
[gateway]
cloud = "prefill"
[device]
model = "smollm2-135m-instruct"
[clouds.prefill]
provider = "llama-server"
base_url = "{llama_server_smollm.v1}"
model = "{SMOLLM}"
[clouds.templated]
base_url = "{llama_server_smollm.v1}"
model = "{SMOLLM}"
continuation = "completions"
template = "{SMOLLM}"
""")
    for name in ("prefill", "templated"):
        done = subprocess.run(
            [sys.executable, "-m", "app.cli", "check-cloud", name, "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "continuation:  continued" in done.stdout, done.stdout


def test_check_cloud_says_llama_server_without_prefill_restarts(tmp_path, capsys):
    # `--no-prefill-assistant`: a final assistant message is history, so the `llama-server` preset's dialect does not
    # continue there. A restart spells the answer so far again token by token; it is not taken for the echo.
    server = start_llama_server(model_path(SMOLLM), alias=SMOLLM, ctx_size=512, extra_args=("--no-prefill-assistant",))
    try:
        config = tmp_path / "clouds.toml"
        config.write_text(f"""
[gateway]
cloud = "restarting"
[clouds.restarting]
provider = "llama-server"
base_url = "{server.v1}"
model = "{SMOLLM}"
""")
        status = check_cloud.run(load_settings(config), "restarting")
    finally:
        stop_server(server)
    out = capsys.readouterr().out
    assert status == 1 and "continuation:  restarted" in out and "fresh answer:  ok" in out, out
    assert "took the answer so far as history" in out
