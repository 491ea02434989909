"""POST /v1/embeddings through the real `openai` SDK against a real gateway (conftest's `fallback_gateway`), with
the bundled all-MiniLM-L6-v2 computing on the device."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

MODEL = "all-minilm-l6-v2"
TEXTS = ["The cat sat on the mat.", "A kitten is resting on a rug.", "Quarterly revenue grew by eight percent."]


@pytest.fixture(scope="module")
def client(fallback_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=fallback_gateway.v1, api_key="unused", max_retries=0, timeout=120)


def test_sdk_embeds_a_batch_with_meaning(client):
    result = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in result.data] == [0, 1, 2] and result.model == MODEL
    vectors = np.array([d.embedding for d in result.data])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    cat_kitten, cat_revenue = vectors[0] @ vectors[1], vectors[0] @ vectors[2]
    assert cat_kitten > cat_revenue + 0.2, (cat_kitten, cat_revenue)
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(TEXTS)


def test_one_text_is_stable_and_both_encodings_agree(client, fallback_gateway):
    first = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    again = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    assert first == again
    r = httpx.post(
        fallback_gateway.v1 + "/embeddings", json={"model": MODEL, "input": TEXTS[0], "encoding_format": "float"}
    )
    assert r.status_code == 200 and r.headers["x-request-id"]
    assert np.allclose(r.json()["data"][0]["embedding"], first, atol=1e-6)
    # A different text gives a different vector (and the batch position does not change a text's vector).
    other = client.embeddings.create(model=MODEL, input=[TEXTS[2], TEXTS[0]]).data
    assert other[0].embedding != first and np.allclose(other[1].embedding, first, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "text-embedding-3-small", "input": "hi"}, 404, "model"),
        ({"model": MODEL, "input": ""}, 400, "input"),
        ({"model": MODEL, "input": []}, 400, "input"),
        ({"model": MODEL, "input": [1, 2, 3]}, 400, "input"),  # token ids: text only
        ({"model": MODEL, "input": "hi", "dimensions": 64}, 400, "dimensions"),
    ],
)
def test_bad_embedding_requests_are_named(fallback_gateway, body, status, param):
    r = httpx.post(fallback_gateway.v1 + "/embeddings", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_models_lists_the_embedding_model(client):
    assert MODEL in [m.id for m in client.models.list()]
