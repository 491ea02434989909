"""POST /v1/embeddings on the OpenAI wire contract, computed on the device (clients/embeddings.py).

`encoding_format: "base64"` (what the OpenAI Python SDK asks for by default) is each vector's little-endian
float32 bytes in base64; "float" is a JSON list.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Request

from endpoints.auth import require_api_key
from endpoints.errors import ApiError
from endpoints.schemas import EmbeddingRequest

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    embedder = await request.app.state.gateway.embedding_model()
    if body.model != embedder.model_id:
        raise ApiError(
            404,
            f"The embedding model '{body.model}' does not exist. Available: {embedder.model_id}.",
            param="model",
            code="model_not_found",
        )
    vectors, tokens = await embedder.embed(body.texts)
    if body.encoding_format == "base64":
        encoded = [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors]
    else:
        encoded = [v.tolist() for v in vectors]
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
        "model": embedder.model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
