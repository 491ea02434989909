"""Pure logic of logprobs: the relay's aligner (text and logprobs on token boundaries, stop sequences), the
OpenAI renderings, upstream conversion, and the logit adjusters (penalties, logit_bias)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.serving.relay import Relay
from clients.base import GenerationRequest, TokenEvent, TokenLogprob
from clients.logprobs import LogprobAligner, NumpyLogitAdjuster, entry_from_logprobs, log_softmax
from clients.openai_compat import _logprobs
from clients.sampling import LogitAdjuster, token_logprob
from endpoints.logprobs import CompletionLogprobs, chat_logprobs


def relay(pieces: list[str], stops: tuple[str, ...] = ()) -> list[tuple[str, tuple[str, ...]]]:
    """The gateway's relay (app/serving/relay.py) over a stream of one-token events: (delta text, its tokens)."""
    gen = GenerationRequest(prompt_text="p", max_tokens=len(pieces), stop=stops, logprobs=0)
    answer, out = Relay(gen, t_first=0.0, consumption_rate=1.0), []
    for i, piece in enumerate(pieces):
        delta = answer.feed(TokenEvent(piece, i, logprobs=(TokenLogprob(-0.5, piece.encode()),)), 0.0)
        out.append((delta.text, tuple(e.token for e in delta.logprobs)))
        if delta.finish_reason is not None:
            break
    return out


def test_every_delta_is_its_tokens_joined():
    out = relay([" The", " answer", " is", " 42", "."])
    assert [tokens for _, tokens in out] == [(" The",), (" answer",), (" is",), (" 42",), (".",)]
    assert all(text == "".join(tokens) for text, tokens in out)


def test_text_held_by_a_stop_prefix_waits_for_its_token_end():
    # " an" may start the stop "answer!": held; " answer" completes no stop, all goes out with both tokens.
    out = relay([" The", " an", "swer", " is"], stops=(" answer!",))
    assert all(text == "".join(tokens) for text, tokens in out)
    assert "".join(t for t, _ in out) == " The answer is"


def test_a_token_cut_by_a_stop_sequence_keeps_its_delivered_part():
    out = relay([" The", " answer", " is", " forty"], stops=("swer",))
    assert "".join(t for t, _ in out) == " The an"
    assert [tok for _, toks in out for tok in toks] == [" The", " an"]  # " answer" trimmed to what was delivered


def test_tokens_with_no_text_yet_travel_with_the_next_text():
    aligner = LogprobAligner()
    aligner.add(TokenEvent("", 1, logprobs=(TokenLogprob(-1.0, b"\xc3"),)))
    assert aligner.release("") == ("", ())
    aligner.add(TokenEvent("é", 2, logprobs=(TokenLogprob(-2.0, b"\xa9"),)))
    text, lps = aligner.release("é")
    assert text == "é" and [e.bytes for e in lps] == [b"\xc3", b"\xa9"]
    assert b"".join(e.bytes for e in lps).decode() == "é"


def test_text_without_logprobs_gets_a_null_entry():
    aligner = LogprobAligner()
    aligner.add(TokenEvent(" hi"))
    text, lps = aligner.release(" hi")
    assert text == " hi" and lps[0].logprob is None and lps[0].token == " hi"


def test_renderings():
    entries = [
        TokenLogprob(-0.25, b" a", ((" a", -0.25, b" a"), (" b", float("-inf"), b" b")), " a"),
        TokenLogprob(-1.0, b"!", (), "!"),
    ]
    chat = chat_logprobs(entries)
    assert chat["refusal"] is None
    assert chat["content"][0] == {
        "token": " a",
        "logprob": -0.25,
        "bytes": [32, 97],
        "top_logprobs": [
            {"token": " a", "logprob": -0.25, "bytes": [32, 97]},
            {"token": " b", "logprob": -9999.0, "bytes": [32, 98]},  # JSON has no -Infinity
        ],
    }
    comp = CompletionLogprobs()
    first = comp.render(entries[:1])
    second = comp.render(entries[1:])
    assert first == {
        "tokens": [" a"],
        "token_logprobs": [-0.25],
        "top_logprobs": [{" a": -0.25, " b": -9999.0}],
        "text_offset": [0],
    }
    assert second["text_offset"] == [2]  # offsets continue across chunks


def test_upstream_logprobs_both_shapes():
    chat = {
        "content": [
            {
                "token": "Hi",
                "logprob": -0.1,
                "bytes": [72, 105],
                "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": None}],
            }
        ]
    }
    (e,) = _logprobs(chat, 1)
    assert (e.token, e.logprob, e.bytes, e.top) == ("Hi", -0.1, b"Hi", (("Hi", -0.1, b"Hi"),))
    comp = {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, None],
        "top_logprobs": [{"x": -3.0, "a": -0.5}, None],
        "text_offset": [0, 1],
    }
    a, b = _logprobs(comp, 2)
    assert a.top == (("a", -0.5, b"a"), ("x", -3.0, b"x")) and b.logprob is None and b.top == ()
    assert _logprobs(None, 2) is None and _logprobs({"content": [{"token": 1}]}, 2) is None


def test_upstream_alternatives_are_trimmed_to_the_k_asked_likeliest_first():
    """llama-cpp-python's server adds the sampled token to the k likeliest when it is not among them; OpenAI returns
    exactly k."""
    comp = {"tokens": ["a"], "token_logprobs": [-2.0], "top_logprobs": [{"a": -2.0, "x": -0.5, "y": -1.0}]}
    (a,) = _logprobs(comp, 2)
    assert a.top == (("x", -0.5, b"x"), ("y", -1.0, b"y")) and a.logprob == -2.0
    alternatives = [{"token": t, "logprob": v} for t, v in (("a", -2.0), ("y", -1.0), ("x", -0.5))]
    (e,) = _logprobs({"content": [{"token": "a", "logprob": -2.0, "top_logprobs": alternatives}]}, 2)
    assert [t for t, _, _ in e.top] == ["x", "y"]
    assert _logprobs(comp, 0)[0].top == ()


def test_numpy_entry_and_adjuster():
    logits = np.array([1.0, 3.0, 2.0, 0.0], dtype=np.float32)
    lp = log_softmax(logits)
    assert np.isclose(np.exp(lp).sum(), 1.0)
    e = entry_from_logprobs(lp, 2, 3, lambda t: f"t{t}".encode())
    assert e.logprob == pytest.approx(float(lp[2]))
    assert [t for t, _, _ in e.top] == ["t1", "t2", "t0"]
    adj = NumpyLogitAdjuster(4, presence=0.5, frequency=1.0, bias=((3, 10.0),), answer=[1, 1])
    out = adj.apply(logits)
    assert out.tolist() == pytest.approx([1.0, 3.0 - 2.0 - 0.5, 2.0, 10.0])
    adj.accept(2)
    assert adj.apply(logits)[2] == pytest.approx(2.0 - 1.5)


def test_torch_adjuster_counts_drafts_before_a_position():
    req = GenerationRequest(prompt_text="", presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((0, -100.0),))
    adj = LogitAdjuster(req, answer=[2])
    logits = torch.zeros(4)
    assert adj.apply(logits).tolist() == pytest.approx([-100.0, 0.0, -1.5, 0.0])
    assert adj.apply(logits, extra=[1, 1]).tolist() == pytest.approx([-100.0, -2.0, -1.5, 0.0])
    adj.accept(3)
    assert adj.apply(logits)[3] == pytest.approx(-1.5)
    e = token_logprob(torch.tensor([0.0, 1.0, 2.0]), 1, 2, lambda t: bytes([97 + t]))
    assert e.top[0][0] == "c" and e.logprob == pytest.approx(
        float(torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), 0)[1])
    )
