"""The cloud backend's SSE line splitter (clients/openai_compat.py) reads bytes as the transport delivers
them: lines must come out whole wherever the chunks were cut."""

from __future__ import annotations

import gzip

import httpx

from clients.openai_compat import _sse_lines

_STREAM = b'data: {"a": "x\xc3\xa9"}\n\n: ping\r\n\r\ndata: {"b": 2}\r\rdata: [DONE]\n\n'
_LINES = [b'data: {"a": "x\xc3\xa9"}', b": ping", b'data: {"b": 2}', b"data: [DONE]"]


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk


async def _lines(chunks: list[bytes], headers: dict | None = None) -> list[bytes]:
    response = httpx.Response(200, headers=headers or {}, stream=_Chunks(chunks))
    return [line async for line in _sse_lines(response) if line]  # blank lines only separate events


async def test_lines_come_out_whole_wherever_the_chunks_are_cut() -> None:
    assert await _lines([_STREAM]) == _LINES
    for cut in range(1, len(_STREAM)):
        assert await _lines([_STREAM[:cut], b"", _STREAM[cut:]]) == _LINES, cut
    assert await _lines([bytes([b]) for b in _STREAM]) == _LINES
    assert await _lines([b"data: no line end"]) == [b"data: no line end"]


async def test_a_compressed_answer_is_decoded_first() -> None:
    assert await _lines([gzip.compress(_STREAM)], {"content-encoding": "gzip"}) == _LINES
