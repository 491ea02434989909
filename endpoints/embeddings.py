"""POST /v1/embeddings on the OpenAI wire contract, computed on the device (clients/embeddings.py).

`encoding_format: "base64"` (what the OpenAI Python SDK asks for by default) is each vector's little-endian
float32 bytes in base64; "float" is a JSON list.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends

from endpoints.auth import require_api_key
from endpoints.schemas import EmbeddingRequest
from endpoints.serving import ServingDep

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, serving: ServingDep):
    vectors, tokens = await serving.embed(body.model, body.texts)
    if body.encoding_format == "base64":
        encoded = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        encoded = [v.tolist() for v in vectors]
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
        "model": body.model,  # the embedding model's id: anything else was refused
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
