"""Cloud backend on any OpenAI-compatible server (vLLM, SGLang, llama.cpp server, a provider).

One shared `httpx.AsyncClient` per backend with explicit connect / read (the longest gap between two streamed
chunks) / write / pool timeouts; streamed requests go straight to its pooled transport. Each stream owns its
upstream response and closes it when the consumer closes the iterator, is cancelled, or the client disconnects —
an unclosed streaming response would pin a pool connection for good.

Continuation from a delivered prefix goes in the upstream's own dialect (clients/continuation.py): a final
assistant message (prefill, `prefix: true`, `continue_final_message`), or raw `/v1/completions` with the chat
template applied here (the device's, with token IDs where the upstream takes them, or the upstream's own when its
tokenizer differs); a plain chat upstream can only start answers. An upstream that takes GBNF (llama.cpp's
servers) gets a request's forced tool call or JSON format as a `grammar`, residual over the delivered prefix when
it continues one (clients/gbnf.py), so it follows it and can take over under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import jsonschema

from clients import gbnf
from clients.base import (
    BackendError,
    Concurrency,
    GenerationRequest,
    NoPrefixCache,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from clients.continuation import completions_prompt
from clients.dialects import GENERIC, Dialect
from clients.http_transport import AsyncioHTTPTransport
from clients.tokencount import estimate_tokens
from policies.breaker import BreakerSettings, CircuitBreaker, RetrySettings, parse_retry_after, retry_wait

log = logging.getLogger(__name__)


# The window of an upstream whose settings name none and whose /v1/models reports none (docs/configuration.md).
DEFAULT_CONTEXT_WINDOW = 32_768
# Where servers report a model's window in /v1/models, in order: vLLM, OpenRouter and Tandem, Mistral, Groq; llama.cpp's
# llama-server under `meta` (`n_ctx`: a slot's window, which a request gets; then the trained one).
_WINDOW_KEYS = ("max_model_len", "context_length", "max_context_length", "context_window")
_META_WINDOW_KEYS = ("n_ctx", "n_ctx_train")


def reported_window(models: object, model: str) -> int | None:
    """The context window an OpenAI-compatible server's /v1/models body reports for `model` (or for its only model,
    by whatever name it lists it), None when it reports none."""
    entries = models.get("data") if isinstance(models, dict) else None
    if not isinstance(entries, list):
        return None
    entries = [e for e in entries if isinstance(e, dict)]
    named = [e for e in entries if e.get("id") == model] or (entries if len(entries) == 1 else [])
    for entry in named:
        meta = entry.get("meta") if isinstance(entry.get("meta"), dict) else {}
        for value in [entry.get(k) for k in _WINDOW_KEYS] + [meta.get(k) for k in _META_WINDOW_KEYS]:
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


@dataclass(frozen=True)
class UpstreamOptions:
    """What the backend needs to know of its upstream (the composition root builds it from the settings)."""

    base_url: str
    model: str
    api_key: str | None = None
    shares_device_tokenizer: bool = False  # exact usage and token-id continuation with the device's tokenizer
    # How it continues an answer, the request fields it takes, how it reports usage (clients/dialects.py).
    dialect: Dialect = GENERIC
    # "completions" to an upstream with a tokenizer of its own: its chat template, which continuations render
    chat_template: str | None = None
    token_id_prompts: bool = False  # the upstream takes prompts as token ids
    native_structure: bool = True  # a chat upstream takes tools / tool_choice / response_format
    # Its response_format takes {"type": "json_object"} only (DeepSeek): a json_schema format goes as json_object with
    # the schema in a system message, and the answer is checked against the schema before it is called finished.
    json_object_only: bool = False
    gbnf: bool = False  # a completions upstream enforces a GBNF `grammar` field (llama.cpp's servers)
    # Its context window, from the settings (the entry's `context_length`, its provider's preset, an embedded server's
    # n_ctx); None: read from its /v1/models at start-up (`reported_window`), else DEFAULT_CONTEXT_WINDOW.
    context_window: int | None = None
    logprobs: bool = True  # it computes logprobs (an embedded llama-cpp-python server without logits_all does not)
    connect_timeout: float = 3.0
    read_timeout: float = 60.0  # the longest silence between two streamed chunks
    write_timeout: float = 10.0
    pool_timeout: float = 5.0
    max_connections: int = 64
    # Failures before the first token: retried (429, 5xx, a refused connection), and remembered (policies/breaker.py).
    retry: RetrySettings = field(default_factory=RetrySettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)

    def __repr__(self) -> str:  # never the key
        return f"UpstreamOptions(base_url={self.base_url!r}, model={self.model!r})"


class OpenAICompatBackend(NoPrefixCache):
    locality = "cloud"

    def __init__(
        self,
        name: str,
        options: UpstreamOptions,
        count_exact: Callable[[str], int] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.name = name
        self.model_id = options.model
        self.options = options
        # The device tokenizer when upstream shares it: exact usage without upstream help.
        self._count_exact = count_exact if options.shares_device_tokenizer else None
        self.dialect = options.dialect
        self.can_continue = options.dialect.continuation.continues
        self.device_vocabulary = options.shares_device_tokenizer
        # Everything but requests with tools goes to /chat/completions, except to a completions upstream that shares
        # the device's template: that one gets the gateway's rendered prompt whenever there are tools or a prefix.
        self._gateway_prompt = options.dialect.continuation.raw_prompt and options.chat_template is None
        # A chat request's upstream enforces tools and response_format itself; a raw prompt is only text, unless the
        # upstream takes a GBNF grammar.
        if self._gateway_prompt:
            self.structured_output = "gbnf" if options.gbnf else "none"
        else:
            self.structured_output = "native" if options.native_structure else "none"
        self.accepts_token_ids = options.token_id_prompts
        # Uncompressed answers: a compressed stream holds tokens back in the compressor, and raw bytes are
        # what `_sse_lines` reads.
        headers = {"Accept-Encoding": "identity"}
        if options.api_key is not None:
            headers["Authorization"] = f"Bearer {options.api_key}"
        # The streamed requests go straight to the transport: the client's cookie, auth and redirect layers
        # cost the first token ~0.1 ms and do nothing for an API upstream.
        self._transport = transport or AsyncioHTTPTransport(
            max_connections=options.max_connections, max_keepalive_connections=16
        )
        self._client = httpx.AsyncClient(
            base_url=options.base_url,
            headers=headers,
            timeout=httpx.Timeout(
                connect=options.connect_timeout,
                read=options.read_timeout,
                write=options.write_timeout,
                pool=options.pool_timeout,
            ),
            transport=self._transport,
        )
        # Absolute URLs parsed once: httpx parses and merges a relative one on every request.
        self._urls = {path: httpx.URL(options.base_url + path) for path in ("/chat/completions", "/completions")}
        self.active = 0
        self.tokens_generated = 0  # streamed text pieces received from upstream
        self.breaker = CircuitBreaker(options.breaker)  # the orchestrator's planner reads it too
        self.on_retry: Callable[[], None] | None = None  # told before each retry (a metric counts them)
        self._jitter = random.Random()
        # The settings' window, else the default until the upstream's /v1/models says otherwise (read once).
        self.context_window = options.context_window or DEFAULT_CONTEXT_WINDOW
        self._window_read = options.context_window is not None

    async def start(self) -> None:
        if not self._window_read:
            await self.ready()  # its /v1/models, for the window it reports (a failure leaves it to a later check)

    async def close(self) -> None:
        await self._client.aclose()

    async def ready(self) -> bool:
        try:
            response = await self._client.get("/models", timeout=2.0)
        except httpx.HTTPError:
            return False
        if response.status_code == 200 and not self._window_read:
            self._window_read = True
            window = None
            with contextlib.suppress(ValueError):  # not JSON: it says no window
                window = reported_window(response.json(), self.options.model)
            self.context_window = window or self.context_window  # the gateway logs it when ready
        return response.status_code == 200

    def count_tokens(self, text: str) -> tuple[int, bool]:
        if self._count_exact is not None:
            return self._count_exact(text), True
        return estimate_tokens(text), False

    def concurrency(self) -> Concurrency:
        return Concurrency()  # an upstream says nothing of how it batches: planned as one at a time, none held back

    # -- request building --------------------------------------------------------------------
    def _body(self, request: GenerationRequest) -> tuple[str, dict]:
        common = {
            "model": self.options.model,
            "stream": True,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if self.dialect.stream_usage:
            common["stream_options"] = {"include_usage": True}
        if request.stop:
            common["stop"] = list(request.stop)
        if request.seed is not None:
            common["seed"] = request.seed
        # Fields beyond the core (reasoning_effort, llama.cpp's min_p, ...) go where the dialect takes them.
        common.update(self.dialect.forwarded(request.forwardable))
        self._sampling_fields(request, common)
        continuing = bool(request.prefill or request.prefix_text or request.prefix_ids)
        continuation = self.dialect.continuation
        constrained = self.structured_output == "gbnf" and request.gbnf is not None
        # Tools go in the prompt rendered by the gateway where the upstream takes raw prompts: the calls come back
        # as text in the one format the gateway reads (app/serving/structured.py).
        if request.messages is None or (self._gateway_prompt and (continuing or request.tools or constrained)):
            if not continuation.raw_prompt:
                raise BackendError(f"cloud backend {self.name!r} serves chat only", status=400, backend=self.name)
            if self.accepts_token_ids and request.prompt_ids is not None and (request.prefix_ids or not continuing):
                prompt: str | list[int] = list(request.prompt_ids) + list(request.prefix_ids or ())
            else:
                prompt = request.prompt_text + request.prefix_text
            fields = self._completion_logprobs(request)
            if constrained:
                fields["grammar"] = request.gbnf  # stream() makes it the residual when it reads the prefix too
            return "/completions", {**common, **fields, "prompt": prompt}
        messages: list[dict] = list(request.messages)
        head = request.prefill + request.prefix_text  # the answer so far, as text
        if continuing and continuation.raw_prompt:
            prompt = completions_prompt(self.options.chat_template, messages, head, request.tools)
            return "/completions", {**common, **self._completion_logprobs(request), "prompt": prompt}
        body = dict(common)
        if continuing:
            if not continuation.chat:
                raise BackendError(
                    f"cloud backend {self.name!r} cannot continue an answer (continuation='chat')",
                    status=501,
                    backend=self.name,
                )
            messages, fields = continuation.chat_request(messages, head)
            body.update(fields)
        if request.logprobs is not None:
            body["logprobs"] = True
            body["top_logprobs"] = request.logprobs
        fmt = request.response_format
        if fmt is not None and fmt.get("type") == "json_schema" and self.options.json_object_only:
            messages = [_schema_instruction(fmt["json_schema"]), *messages]
            fmt = {"type": "json_object"}
        body["messages"] = messages
        if request.tools:
            body["tools"] = list(request.tools)
            body["parallel_tool_calls"] = request.parallel_tool_calls
            if request.tool_choice is not None:
                body["tool_choice"] = request.tool_choice
        if fmt is not None:
            body["response_format"] = fmt
        return "/chat/completions", body

    @staticmethod
    def _completion_logprobs(request: GenerationRequest) -> dict:
        return {"logprobs": request.logprobs} if request.logprobs is not None else {}

    async def _residual_grammar(self, request: GenerationRequest) -> str:
        """The request's GBNF past the delivered prefix, for a continuation whose grammar reads the prefix (on a
        thread: ~0.1 ms a character). A 400 when the prefix leaves the grammar: this upstream cannot take over."""
        try:
            return await asyncio.to_thread(gbnf.residual, request.gbnf, request.prefix_text)
        except gbnf.GBNFError as exc:
            raise BackendError(f"cloud backend {self.name!r}: {exc}", status=400, backend=self.name) from exc

    def _sampling_fields(self, request: GenerationRequest, body: dict) -> None:
        """Penalties and logit_bias, passed through (logprobs go in the shape of the path's API). Logprobs where it
        computes none: not implemented here (501: the request goes elsewhere, nothing told to the breaker)."""
        if request.logprobs is not None and not self.options.logprobs:
            raise BackendError(f"cloud backend {self.name!r} computes no logprobs", 501, self.name)
        if request.presence_penalty:
            body["presence_penalty"] = request.presence_penalty
        if request.frequency_penalty:
            body["frequency_penalty"] = request.frequency_penalty
        if request.logit_bias:
            if not self.options.shares_device_tokenizer:
                raise BackendError(
                    f"cloud backend {self.name!r} has a vocabulary of its own: logit_bias (device token ids) "
                    "cannot apply there",
                    status=400,
                    backend=self.name,
                )
            body["logit_bias"] = {str(tok): bias for tok, bias in request.logit_bias}

    # -- streaming ---------------------------------------------------------------------------
    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        path, body = self._body(request)
        if "grammar" in body and request.prefix_text and request.grammar_covers_prefix:
            body["grammar"] = await self._residual_grammar(request)
        url = self._urls[path]
        self.active += 1
        try:
            response = await self._answer(url, body)
            try:
                async for event in self._events(response, request):
                    yield event
            finally:
                await response.aclose()
        except httpx.ReadTimeout as exc:
            raise BackendError(
                f"cloud backend {self.name!r} sent nothing for {self.options.read_timeout:g} s (stalled)",
                504,
                self.name,
            ) from exc
        except httpx.PoolTimeout as exc:
            raise BackendError(f"cloud backend {self.name!r}: connection pool exhausted", 503, self.name) from exc
        except httpx.HTTPError as exc:
            raise BackendError(f"cloud backend {self.name!r} failed: {exc!r}", 502, self.name) from exc
        finally:
            self.active -= 1

    async def _answer(self, url: httpx.URL, body: dict) -> httpx.Response:
        """The upstream's 200 answer (its body not read yet). A failure a retry may cure (429, 5xx, a refused
        connection) is tried again on the retry schedule, honouring `Retry-After`; each such failure is told to the
        breaker, and a 200 closes it."""
        waited = 0.0
        retry = 0
        while True:
            retry_after = None
            try:
                response = await self._transport.handle_async_request(
                    self._client.build_request("POST", url, json=body)
                )
            except httpx.ConnectError as exc:
                error = BackendError(f"cloud backend {self.name!r} is unreachable at {url}: {exc}", 503, self.name)
            except httpx.ConnectTimeout:
                error = BackendError(f"cloud backend {self.name!r} did not accept a connection in time", 504, self.name)
            else:
                if response.status_code == 200:
                    self.breaker.succeeded()
                    return response
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                error = self._upstream_error(response)
                if response.status_code != 429 and response.status_code < 500:
                    raise error  # the request's own fault, or auth trouble: another try will not differ
                retry_after = parse_retry_after(response.headers.get("retry-after"), time.time())
            self.breaker.failed(str(error), time.monotonic(), retry_after)
            wait = retry_wait(self.options.retry, retry, waited, retry_after, self._jitter.random())
            if wait is None:
                cooling = self.breaker.cooling(time.monotonic(), time.time())
                if cooling is not None:
                    error = BackendError(f"{error}; {cooling}", error.status, self.name)
                raise error
            log.info("cloud backend %s: %s; retrying in %.2f s", self.name, error, wait)
            if self.on_retry is not None:
                self.on_retry()
            await asyncio.sleep(wait)
            waited += wait
            retry += 1

    def _upstream_error(self, response: httpx.Response) -> BackendError:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:300]
        status = response.status_code
        # A client-side mistake upstream is the client's; auth trouble upstream is ours (502).
        mapped = status if status in (400, 413, 422, 429) else 502
        return BackendError(f"cloud backend {self.name!r} answered {status}: {message}", mapped, self.name)

    async def _events(self, response: httpx.Response, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        kind = response.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind and kind != "text/event-stream":  # e.g. a proxy's HTML page, or a server that ignored stream=true
            raise self._malformed(f"answered 200 with content-type {kind!r}, not an event stream")
        finish: str | None = None
        usage: Usage | None = None
        calls: dict[int, dict] = {}  # a chat upstream's tool calls, assembled from their pieces
        fmt = request.response_format
        schema = None  # the schema the answer is checked against here: the upstream only made it JSON
        if fmt is not None and fmt.get("type") == "json_schema" and self.options.json_object_only:
            schema = fmt["json_schema"].get("schema") or {"type": "object"}
        written: list[str] = []
        lines = _sse_lines(response)
        async for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments (keep-alive pings), event names
            data = line[5:].strip()
            if data == b"[DONE]":
                # Read the response to its end so the connection goes back to the pool: closing a
                # half-read response costs a new TCP connection on the next request.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        async for _ in lines:
                            pass
                break
            try:
                chunk = json.loads(data)
            except ValueError as exc:
                raise self._malformed(f"sent malformed SSE data: {data[:100]!r}") from exc
            if not isinstance(chunk, dict):
                raise self._malformed(f"sent a chunk that is not a JSON object: {data[:100]!r}")
            if "error" in chunk:
                err = chunk["error"]
                message = err.get("message") if isinstance(err, dict) else str(err)
                raise BackendError(f"cloud backend {self.name!r} failed mid-stream: {message}", 502, self.name)
            if chunk.get("usage"):
                usage = self._usage(chunk["usage"], data)
            for text, reason, lps, pieces, reasoning in self._choices(chunk, data, request.logprobs):
                if reasoning:
                    yield TokenEvent(text="", reasoning=reasoning)
                if text:
                    self.tokens_generated += 1
                    if schema is not None:
                        written.append(text)
                    yield TokenEvent(text=text, logprobs=lps)
                for piece in pieces:
                    self._add_call_piece(calls, piece, data)
                finish = reason or finish
        else:
            if finish is None:
                # Neither a finish reason nor [DONE]: the upstream stopped before saying the answer is complete.
                raise self._malformed("ended its stream without a finish reason or [DONE] (truncated answer)")
        for i in sorted(calls):
            yield TokenEvent(text=_call_text(calls[i]))
        if schema is not None and finish != "length":
            self._check_schema("".join(written), schema)
        yield TokenEvent(text="", finish_reason="stop" if finish == "tool_calls" else finish or "stop", usage=usage)

    def _add_call_piece(self, calls: dict[int, dict], piece, data: bytes) -> None:
        function = piece.get("function") if isinstance(piece, dict) else None
        if not isinstance(function, dict) or not isinstance(piece.get("index", 0), int):
            raise self._malformed(f"sent a malformed tool call: {data[:100]!r}")
        call = calls.setdefault(piece.get("index", 0), {"name": "", "arguments": ""})
        for key in ("name", "arguments"):
            value = function.get(key)
            if not isinstance(value, str | None):
                raise self._malformed(f"sent a tool call whose {key} is not a string: {data[:100]!r}")
            call[key] += value or ""

    def _check_schema(self, text: str, schema: dict) -> None:
        """Raises unless `text` is JSON that `schema` accepts (an answer cut by max_tokens is not checked)."""
        try:
            jsonschema.validate(json.loads(text), schema)
        except ValueError as exc:
            raise self._malformed(f"answered in JSON mode with text that is not JSON: {exc}") from exc
        except jsonschema.ValidationError as exc:
            raise self._malformed(f"answered JSON that response_format's schema refuses: {exc.message}") from exc

    def _malformed(self, what: str) -> BackendError:
        return BackendError(f"cloud backend {self.name!r} {what}", 502, self.name)

    def _choices(
        self, chunk: dict, data: bytes, logprobs: int | None = None
    ) -> list[tuple[str, str | None, tuple[TokenLogprob, ...] | None, list, str]]:
        """(text, finish reason, logprobs if asked (`logprobs` alternatives a token), tool call pieces, reasoning) of
        each choice of a chunk; a chunk
        of any other shape is an upstream fault. Reasoning is a chat delta's `reasoning_content` (DeepSeek, vLLM
        before 0.10, llama-server, SGLang) or `reasoning` (vLLM since, OpenRouter, Ollama)."""
        choices = chunk.get("choices")
        if choices is None:
            return []
        if not isinstance(choices, list):
            raise self._malformed(f"sent a chunk whose 'choices' is not a list: {data[:100]!r}")
        out = []
        for choice in choices:
            if not isinstance(choice, dict):
                raise self._malformed(f"sent a choice that is not a JSON object: {data[:100]!r}")
            pieces = []
            reasoning = None
            if "text" in choice:
                text = choice["text"]
            else:
                delta = choice.get("delta")
                if delta is None:
                    delta = {}
                if not isinstance(delta, dict):
                    raise self._malformed(f"sent a delta that is not a JSON object: {data[:100]!r}")
                text = delta.get("content")
                reasoning = delta.get("reasoning_content")
                if reasoning is None:
                    reasoning = delta.get("reasoning")
                pieces = delta.get("tool_calls") or []
                if not isinstance(pieces, list):
                    raise self._malformed(f"sent tool_calls that are not a list: {data[:100]!r}")
            reason = choice.get("finish_reason")
            if not all(isinstance(v, str | None) for v in (text, reason, reasoning)):
                raise self._malformed(
                    f"sent a choice whose text, reasoning or finish_reason is not a string: {data[:100]!r}"
                )
            lps = _logprobs(choice.get("logprobs"), logprobs) if logprobs is not None else None
            out.append((text or "", reason, lps, pieces, reasoning or ""))
        return out

    def _usage(self, u, data: bytes) -> Usage:
        """The upstream's usage, with the parts it bills apart: `prompt_tokens_details.cached_tokens` (OpenAI, and
        DeepSeek's `prompt_cache_hit_tokens`) and `completion_tokens_details.reasoning_tokens`. A detail that is
        absent or null counts 0; one of the wrong type, or a part larger than its whole, is an upstream fault."""
        if not isinstance(u, dict):
            raise self._malformed(f"sent a malformed usage object: {data[:100]!r}")
        prompt_details = u.get("prompt_tokens_details")
        completion_details = u.get("completion_tokens_details")
        prompt_details = {} if prompt_details is None else prompt_details
        completion_details = {} if completion_details is None else completion_details
        if not isinstance(prompt_details, dict) or not isinstance(completion_details, dict):
            raise self._malformed(f"sent a malformed usage object: {data[:100]!r}")
        counts = (
            u.get("prompt_tokens", 0),
            u.get("completion_tokens", 0),
            prompt_details.get("cached_tokens") or u.get("prompt_cache_hit_tokens") or 0,
            completion_details.get("reasoning_tokens") or 0,
        )
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise self._malformed(f"sent a malformed usage object: {data[:100]!r}")
        prompt, completion, cached, reasoning = counts
        if cached > prompt or reasoning > completion:
            raise self._malformed(f"sent usage whose parts exceed their totals: {data[:100]!r}")
        return Usage(prompt, completion, exact=True, cached_tokens=cached, reasoning_tokens=reasoning)


def _call_text(call: dict) -> str:
    """A chat upstream's tool call in the text format every other endpoint writes (app/serving/structured.py)."""
    try:
        arguments = json.loads(call["arguments"] or "{}")
    except ValueError:
        arguments = call["arguments"]  # left as it is: the gateway delivers an unparsable call as text
    return f"<tool_call>\n{json.dumps({'name': call['name'], 'arguments': arguments})}\n</tool_call>"


def _logprobs(obj, top: int) -> tuple[TokenLogprob, ...] | None:
    """An upstream choice's logprobs, chat shape (`content: [{token, logprob, bytes, top_logprobs}]`) or completions
    shape (`tokens`, `token_logprobs`, `top_logprobs: [{token: logprob}]`), each token's alternatives the `top`
    likeliest (as OpenAI returns them: llama-cpp-python's server adds the sampled token when it is not among them);
    None when absent or not understood (the relay then reports the text's logprob as null rather than failing a good
    answer)."""
    if not isinstance(obj, dict):
        return None
    try:
        if isinstance(obj.get("content"), list):
            return tuple(
                TokenLogprob(
                    float(e["logprob"]),
                    bytes(e["bytes"]) if e.get("bytes") is not None else e["token"].encode("utf-8"),
                    _likeliest(
                        (
                            str(t["token"]),
                            float(t["logprob"]),
                            bytes(t["bytes"]) if t.get("bytes") is not None else str(t["token"]).encode("utf-8"),
                        )
                        for t in e.get("top_logprobs") or ()
                    )[:top],
                    str(e["token"]),
                )
                for e in obj["content"]
            )
        tokens, values = obj["tokens"], obj["token_logprobs"]
        tops = obj.get("top_logprobs") or [None] * len(tokens)
        return tuple(
            TokenLogprob(
                None if lp is None else float(lp),
                str(tok).encode("utf-8"),
                _likeliest((str(t), float(v), str(t).encode("utf-8")) for t, v in (alternatives or {}).items())[:top],
                str(tok),
            )
            for tok, lp, alternatives in zip(tokens, values, tops, strict=True)
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _likeliest(alternatives) -> tuple[tuple[str, float, bytes], ...]:
    """A token's alternatives, most likely first."""
    return tuple(sorted(alternatives, key=lambda alt: -alt[1]))


async def _sse_lines(response: httpx.Response) -> AsyncIterator[bytes]:
    """The lines of an SSE body, without their line ends (LF, CRLF or CR), as the transport delivers them:
    httpx's text decoding layers cost the first token more than the split itself."""
    if response.headers.get("content-encoding", "identity").lower() != "identity":
        chunks = response.aiter_bytes()  # a server that compressed anyway: httpx decodes it
    else:
        chunks = response.aiter_raw()
    rest = b""
    async for chunk in chunks:
        lines = (rest + chunk).splitlines(keepends=True)
        # The last piece without a line end continues in the next chunk. (A CRLF split between two chunks
        # reads as two line ends: one blank line more, which SSE ignores.)
        rest = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
        for line in lines:
            yield line.rstrip(b"\r\n")
    if rest:
        yield rest


def _schema_instruction(json_schema: dict) -> dict:
    """The system message that asks for a json_schema format where the upstream's JSON mode knows no schema (its
    JSON mode also wants the word "JSON" in the prompt)."""
    schema = json.dumps(json_schema.get("schema") or {"type": "object"}, ensure_ascii=False)
    return {"role": "system", "content": f"Answer with one JSON object that this JSON Schema accepts: {schema}"}
