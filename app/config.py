"""One settings tree: a TOML file, overridden by TANDEM_* environment variables.

Nested fields use `__` in variable names, e.g. `TANDEM_GATEWAY__PORT=9000` or
`TANDEM_CLOUDS__CLOUD__API_KEY=sk-...`. Everything is validated at start-up;
`load_settings` raises `ConfigError` with one line per bad field, named by its
dotted path, so a typo fails fast instead of at the first request.

`tandem worker` reads the same way through `load_worker_settings`: the file's [worker]
table (app/worker/settings.py's WorkerSettings), `TANDEM_WORKER__MAX_SESSIONS=32` and
the like over it, the command line's flags over both.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SecretStr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from app.providers import PRESETS, with_preset
from app.serving.budget import (
    DEFAULT_BUDGET,
    DEFAULT_CONSUMPTION_RATE,
    DEFAULT_EXCHANGE_RATE,
    BudgetValidationError,
)
from app.serving.budget import from_config as budget_from_config
from app.serving.limits import KeyLimits
from app.worker.settings import WorkerSettings
from clients.dialects import UPSTREAM_CONTINUATIONS
from clients.hat.options import HATOptions
from policies.dispatch import DEFAULT_ALPHA, canonical_name, declaration
from policies.quality import DEFAULT_THRESHOLD as DEFAULT_QUALITY_THRESHOLD


class ConfigError(ValueError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ApiKeySettings(_Strict):
    """An API key with settings of its own: a privacy level (policies/privacy.py), its requests never going further;
    caps and rate limits (app/serving/limits.py), held across every replica sharing a store."""

    key: SecretStr
    privacy: Literal["device", "split", "any"] | None = None
    # Names the key in the shared store and the logs (never the secret); default: a hash of the key.
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] | None = None
    cap_usd: Annotated[float, Field(ge=0)] | None = None  # dollars per `period`
    period: Literal["minute", "hour", "day", "month"] = "day"
    at_cap: Literal["device", "reject"] = "device"  # at the cap: answer on the device only, or 429
    rpm: Annotated[int, Field(ge=0)] | None = None  # requests per minute
    tpm: Annotated[int, Field(ge=0)] | None = None  # prompt + completion tokens per minute
    max_streams: Annotated[int, Field(ge=0)] | None = None  # requests in flight at once
    # The most generated tokens a request's reservation covers (a request asking for more books all it gets).
    reserve_tokens: Annotated[int, Field(gt=0)] = 512

    def limits(self) -> KeyLimits:
        """Its name, caps and limits as the core takes them (a key without limits still has its spend booked)."""
        return KeyLimits(
            name=self.name or key_label(self.key),
            cap_usd=self.cap_usd,
            period=self.period,
            at_cap=self.at_cap,
            rpm=self.rpm,
            tpm=self.tpm,
            max_streams=self.max_streams,
            reserve_tokens=self.reserve_tokens,
        )


def default_state_file() -> str:
    """The budget's state file under the XDG base directories: $XDG_STATE_HOME, else ~/.local/state (a test run
    points XDG_STATE_HOME at its own folder, so no gateway it starts reads the user's saved budget)."""
    state_home = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(state_home, "tandem", "budget.json")


def key_label(key: SecretStr) -> str:
    """A key's name where it has none of its own: a short hash, never the secret nor a piece of it."""
    return "sha256-" + hashlib.sha256(key.get_secret_value().encode()).hexdigest()[:16]


def key_limits(entry: SecretStr | ApiKeySettings) -> KeyLimits:
    """Any `api_keys` entry's KeyLimits: a plain key is a key with no limits, named by its hash."""
    return entry.limits() if isinstance(entry, ApiKeySettings) else KeyLimits(name=key_label(entry))


class StateSettings(_Strict):
    """[state]: where the gateway's shared state lives (app/serving/state.py). "memory" (the default) is this
    process; "valkey" is a Redis-protocol server (Valkey, or Redis 7+) that replicas share."""

    backend: Literal["memory", "valkey"] = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tandem:"
    # While the store is unreachable: keep serving on local counts ("local"), or refuse paid clouds ("closed").
    on_store_loss: Literal["local", "closed"] = "local"
    trace_ttl: Annotated[float, Field(gt=0)] = 600.0  # seconds a trace stays readable from every replica
    poll_seconds: Annotated[float, Field(gt=0)] = 1.0  # how often a replica checks the budget's version
    timeout: Annotated[float, Field(gt=0)] = 1.0  # a store call's socket timeout: how soon a loss is noticed
    # Traces that may wait for a lost store (apart from bookings, which all wait); past it the oldest are dropped.
    trace_queue: Annotated[int, Field(ge=1)] = 1000
    # A running request books what it did so far, settles it into its key's books and renews its hold this often: a
    # replica that dies mid-stream loses at most this long's booking.
    settle_seconds: Annotated[float, Field(ge=0.1, le=60)] = 2.0
    # A hold's lease: a hold its replica stops renewing (the replica died) lapses this long after the last renewal.
    hold_seconds: Annotated[float, Field(le=3600)] = 20.0

    @model_validator(mode="after")
    def _lease_outlasts_renewals(self) -> StateSettings:
        if self.hold_seconds < 3 * self.settle_seconds:
            raise ValueError(
                f"state.hold_seconds ({self.hold_seconds:g}) must be at least 3 × state.settle_seconds "
                f"({self.settle_seconds:g}): a hold must outlast a late renewal or two"
            )
        return self


class GatewaySettings(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    model_name: str = "tandem"
    # A key, or {key = "...", privacy = ..., cap_usd = ..., rpm = ..., ...} (ApiKeySettings).
    api_keys: list[SecretStr | ApiKeySettings] = []
    # Where a request may go unless it or its key says otherwise (policies/privacy.py).
    privacy: Literal["device", "split", "any"] = "any"
    # Outline-based parallel decoding unless a request says otherwise (policies/outline.py).
    decoding: Literal["outline", "auto", "sequential"] = "sequential"
    # Keys that may change the budget (PUT / DELETE /v1/budget). Whenever the gateway has any key, only these may;
    # a gateway with no key at all (loopback, one user) lets anyone.
    admin_keys: list[SecretStr] = []
    # Keys the prompt-cache keys derived for conversations (app/serving/cache_key.py): set it to keep clouds' caches
    # warm across restarts and shared by a fleet's gateways; unset, one is drawn at start-up.
    prompt_cache_secret: SecretStr | None = None
    # Where budget settings changed over HTTP are kept across restarts: $XDG_STATE_HOME/tandem/budget.json
    # (~/.local/state/tandem/budget.json when XDG_STATE_HOME is unset), read when the settings load; "" = not kept.
    state_file: str = Field(default_factory=lambda: default_state_file())
    policy: str = "disco"
    cloud: str = "cloud"  # which entry of [clouds] the "cloud" policy and fallbacks use
    # Before the first token, try the other endpoint when the chosen one fails.
    fallback: bool = True
    # The limit of an answer whose request names none; 0: none, as OpenAI's APIs do (it writes until it ends or the
    # serving endpoint's window is full: Codex CLI's Responses requests name none and take an `incomplete` answer for a
    # failed turn).
    default_max_tokens: Annotated[int, Field(ge=0)] = 512
    # A cap on every answer, asked for or not (0: none), as llama-server's --n-predict: a request asking more is
    # clamped and told so (`x-tandem-max-tokens-clamped`, the trace), never refused. Agents ask 32,000 tokens.
    max_answer_tokens: Annotated[int, Field(ge=0)] = 0
    ping_seconds: Annotated[float, Field(gt=0)] = 15.0
    # Mid-answer silence after which the serving endpoint counts as stalled and the
    # answer migrates to the other endpoint (the device's and each cloud's own `stall_timeout` override it).
    stall_timeout: Annotated[float, Field(gt=0)] = 10.0
    trace_history: Annotated[int, Field(gt=0)] = 1000
    # Request bodies larger than this are refused with 413 before they are read whole.
    max_body_bytes: Annotated[int, Field(gt=0)] = 2 * 1024 * 1024
    # A client must send a request's headers and body within this many seconds of its first byte (or of
    # connecting), or the connection is closed: half-sent requests must not hold connections open for good.
    request_read_timeout: Annotated[float, Field(gt=0)] = 15.0
    # Connections and requests served at once; beyond it new requests get 503 (uvicorn's limit_concurrency).
    max_connections: Annotated[int, Field(gt=0)] = 256
    # Append one JSON line per finished request (the format `tandem bench disco --trace` replays).
    trace_file: str = ""
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        canonical_name(value)  # raises naming the known policies
        return value


class DiscoSettings(_Strict):
    """Initial DiSCo knobs; PUT /v1/budget changes them at run time (kept in state_file). Their rules live in
    one place, app/serving/budget.py's BudgetSettings, which checks them when the settings load."""

    budget: float = DEFAULT_BUDGET  # b: share of input tokens on the constrained side
    alpha: float = DEFAULT_ALPHA  # tail ratio
    exchange_rate: float = DEFAULT_EXCHANGE_RATE  # λ, USD per 10^15 device FLOPs
    consumption_rate: float = DEFAULT_CONSUMPTION_RATE  # r_c, tokens/s the reader consumes
    side: str = "auto"  # auto | server | device
    migration: bool = True
    # The quality policy's knob: the device's confidence below which its answer escalates to the cloud, [0, 1].
    quality_threshold: float = DEFAULT_QUALITY_THRESHOLD
    window: Annotated[int, Field(gt=10)] = 2000
    recompute_every: Annotated[int, Field(gt=0)] = 10
    # Fit the device TTFT line from a few real prefills at start-up.
    profile_device: bool = True


class PriceSettings(_Strict):
    """USD per million tokens (DiSCo Table 8; the default is gpt-4o-mini's). Where the provider bills them apart
    (its usage reports `prompt_tokens_details.cached_tokens`, `completion_tokens_details.reasoning_tokens`): prompt
    tokens read from its prompt cache (unset: the prefill price) and reasoning tokens (unset: the decode price)."""

    prefill_per_million: Annotated[float, Field(ge=0)] = 0.15
    decode_per_million: Annotated[float, Field(ge=0)] = 0.60
    cached_per_million: Annotated[float, Field(ge=0)] | None = None
    reasoning_per_million: Annotated[float, Field(ge=0)] | None = None


class DeviceSettings(_Strict):
    kind: Literal["llamacpp", "torch"] = "llamacpp"
    name: str = "device"
    # A bundled model name (see `tandem models`) or a path to a GGUF file.
    model: str = "qwen2.5-coder-0.5b-instruct"
    n_ctx: Annotated[int, Field(gt=0)] = 4096
    n_threads: Annotated[int, Field(gt=0)] = 2
    # The same input (prompt + delivered prefix) gives the same greedy answer whatever the KV cache holds: the input
    # is evaluated in fixed chunks from position 0, reusing only whole chunks (clients/llamacpp.py). Costs up to one
    # chunk of re-evaluation on a repeated prompt; off, the longest cached prefix is reused. The torch backend keeps
    # no cache and always evaluates this way.
    reproducible: bool = False
    # This endpoint's own mid-answer silence that counts as a stall (unset: [gateway] stall_timeout). A device
    # writes at a pace known in advance, while a cloud may pause for long (a provider's queue, a reasoning model's
    # silent thinking): each can be given the patience it deserves.
    stall_timeout: Annotated[float, Field(gt=0)] | None = None
    # The prompt cache (llama.cpp only; docs/prompt-cache.md): KV states of evaluated prefixes, kept past the request
    # and looked up by the longest common token prefix, restored in place of a prefill. In RAM up to this many MiB
    # (least recently used out; 0: only the live KV cache, as without it).
    prompt_cache_mb: Annotated[int, Field(ge=0)] = 1024
    # States of prefixes of at least `prompt_cache_disk_min_tokens` tokens also go to disk, kept across restarts, up
    # to this many MiB (every model's and build's together, oldest out; 0: nothing on disk), in `prompt_cache_dir`
    # (unset: $XDG_CACHE_HOME/tandem/kv, i.e. ~/.cache/tandem/kv).
    prompt_cache_disk_mb: Annotated[int, Field(ge=0)] = 2048
    prompt_cache_disk_min_tokens: Annotated[int, Field(gt=0)] = 1024
    prompt_cache_dir: str = ""


class EmbeddedServerSettings(_Strict):
    """A real OpenAI-compatible server (llama-cpp-python's) that the gateway starts on
    loopback and stops with itself: the stand-in for a remote provider."""

    model: str = "qwen2.5-coder-1.5b-instruct"
    port: Annotated[int, Field(ge=0, le=65535)] = 8001
    n_ctx: Annotated[int, Field(gt=0)] = 4096
    n_threads: Annotated[int, Field(gt=0)] = 2
    # llama.cpp's flash attention: the attention scores of a long window never held whole (its compute buffer ~300 MiB
    # instead of ~1 GB at 32,768 tokens) and long prefills faster (docs/bench/context-windows.md); other numerics.
    flash_attn: bool = False
    # Logits kept for every position, which a completion's logprobs need: an n_ctx × vocabulary array of floats
    # (~20 GB for the bundled Qwen pair at 32,768 tokens, ~7 GB touched by a 12,000-token prompt), and the LM head
    # run over the whole prompt. Off, it computes no logprobs: the gateway sends it no request that asks for them.
    logits_all: bool = True
    startup_timeout: Annotated[float, Field(gt=0)] = 120.0
    cpus: list[int] | None = None  # pin the server to these CPU cores (benchmarks: keep it off the device's)


class CloudSettings(_Strict):
    kind: Literal["openai"] = "openai"
    # A known kind of upstream (app/providers.py): fills in the fields below that the table leaves out.
    provider: Literal[tuple(PRESETS)] | None = None  # type: ignore[valid-type]
    base_url: str = "http://127.0.0.1:8001/v1"
    api_key: SecretStr | None = None
    model: str = "qwen2.5-coder-1.5b-instruct"
    # "device": the upstream model shares the device model's tokenizer (the bundled
    # Qwen pair does), so prompts and continuations go as token IDs and usage is exact.
    # "tiktoken": unknown tokenizer; text continuation, usage estimated with cl100k_base.
    tokenizer: Literal["device", "tiktoken"] = "tiktoken"
    # How to continue an answer from a delivered prefix (clients/dialects.py):
    # "prefill": a final assistant message (llama-server, Anthropic, OpenRouter, Ollama);
    # "prefix-flag": that message with "prefix": true (Mistral, DeepSeek's beta URL);
    # "continue-final-message": that message and continue_final_message = true (vLLM, SGLang);
    # "completions": raw /v1/completions with the chat template applied in the gateway (the device's; or the
    #   upstream's own, named by `template`, for an upstream whose tokenizer differs);
    # "chat": /v1/chat/completions only (no continuation; fresh answers only).
    continuation: Literal[UPSTREAM_CONTINUATIONS] = "chat"  # type: ignore[valid-type]
    # The upstream's chat template, for continuation = "completions" with a tokenizer of its own: a bundled model
    # name, or the path of its GGUF, its tokenizer_config.json or a Jinja template file.
    template: str = ""
    # Upstream accepts `prompt` as a list of token IDs (vLLM does; llama.cpp's Python
    # server does not, so continuations to it go as text and it re-tokenises them).
    token_id_prompts: bool = False
    # Whether a chat upstream takes `tools`, `tool_choice` and `response_format` (OpenAI, vLLM, SGLang and
    # llama.cpp's server do): "none" keeps requests that use them away from it. A completions upstream that shares
    # the device's template gets tools in the prompt the gateway renders; "gbnf" (llama.cpp's llama-server,
    # llama-cpp-python's server: an embedded cloud's default) sends a forced tool call or a JSON format as a GBNF
    # `grammar` it enforces, also when it continues an answer; otherwise such an upstream cannot enforce one ("none").
    # "json_object": response_format takes {"type": "json_object"} only (DeepSeek); a json_schema request goes as
    # json_object with the schema in a system message, and the answer is checked against the schema.
    structured_output: Literal["native", "json_object", "none", "gbnf"] = "native"
    # Ask for usage in the stream (`stream_options`); off for a server that refuses the field (it sends usage anyway).
    stream_usage: bool = True
    # Its context window in tokens, prompt and answer together (no prompt it cannot hold is sent there; max_tokens is
    # clamped to what is left). Unset: its provider preset's, an embedded server's n_ctx, else what its /v1/models
    # reports at start-up (vLLM, llama-server, OpenRouter, Mistral, Tandem), else 32,768 (docs/configuration.md).
    context_length: Annotated[int, Field(gt=0)] | None = None
    connect_timeout: Annotated[float, Field(gt=0)] = 3.0
    read_timeout: Annotated[float, Field(gt=0)] = 60.0  # max gap between two streamed chunks
    write_timeout: Annotated[float, Field(gt=0)] = 10.0
    pool_timeout: Annotated[float, Field(gt=0)] = 5.0
    max_connections: Annotated[int, Field(gt=0)] = 64
    stall_timeout: Annotated[float, Field(gt=0)] | None = None  # as [device]'s: unset, [gateway] stall_timeout
    # Failures before the first token (429, 5xx, a refused connection; policies/breaker.py): tried again up to
    # `retries` times after a backoff from `retry_backoff_seconds` (doubling, with jitter) or the upstream's
    # Retry-After, waiting at most `retry_budget_seconds` in all; `failures_to_open` in a row cool the cloud for
    # `cooldown_seconds`, doubling with each opening up to `max_cooldown_seconds` (a Retry-After: that long).
    retries: Annotated[int, Field(ge=0, le=10)] = 2
    retry_backoff_seconds: Annotated[float, Field(ge=0)] = 0.25
    retry_budget_seconds: Annotated[float, Field(ge=0)] = 4.0
    failures_to_open: Annotated[int, Field(ge=1)] = 3
    cooldown_seconds: Annotated[float, Field(gt=0)] = 1.0
    max_cooldown_seconds: Annotated[float, Field(gt=0)] = 60.0
    price: PriceSettings = PriceSettings()
    embedded: EmbeddedServerSettings | None = None
    # It computes on the device's own hardware (an embedded server does, by construction: unset follows `embedded`):
    # DiSCo then never runs both endpoints at once, since each would slow the other (policies/dispatch.py: unshared).
    co_located: bool | None = None

    @property
    def shares_device(self) -> bool:
        """Whether this cloud computes on the device's own hardware (`co_located`, else whether it is embedded)."""
        return self.co_located if self.co_located is not None else self.embedded is not None

    @property
    def window(self) -> int | None:
        """Its context window as the settings say it (`context_length`, else an embedded server's n_ctx); None: the
        backend reads the upstream's own (clients/openai_compat.py)."""
        if self.context_length is not None:
            return self.context_length
        return self.embedded.n_ctx if self.embedded is not None else None

    @model_validator(mode="after")
    def _window_within_embedded(self) -> CloudSettings:
        if self.embedded is not None and self.context_length is not None and self.context_length > self.embedded.n_ctx:
            raise ValueError(
                f"context_length ({self.context_length}) is more than the embedded server holds (its n_ctx, "
                f"{self.embedded.n_ctx}): leave it unset, or raise [embedded] n_ctx"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _provider_preset(cls, data):
        return with_preset(data) if isinstance(data, dict) else data

    @field_validator("model")
    @classmethod
    def _model_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty: set it to the model name the upstream serves")
        return value

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value:
            raise ValueError("is empty: set it to the upstream's OpenAI-compatible base URL (ending in /v1)")
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        return value.rstrip("/")

    @property
    def gateway_template(self) -> bool:
        """Whether continuations go as the gateway's own rendered prompt (a completions upstream with the device's
        tokenizer), not in a dialect of the upstream's."""
        return self.continuation == "completions" and self.tokenizer == "device"

    @model_validator(mode="after")
    def _cooldown_within_cap(self) -> CloudSettings:
        if self.cooldown_seconds > self.max_cooldown_seconds:
            raise ValueError(
                f"cooldown_seconds ({self.cooldown_seconds:g}) is longer than max_cooldown_seconds "
                f"({self.max_cooldown_seconds:g}): the cool-down doubles from the first up to the cap"
            )
        return self

    @model_validator(mode="after")
    def _completions_needs_template(self) -> CloudSettings:
        if self.continuation == "completions" and self.tokenizer != "device" and not self.template:
            raise ValueError(
                "continuation='completions' needs the upstream's chat template: set tokenizer='device' (the "
                "upstream shares the device model's tokenizer) or template = its GGUF, tokenizer_config.json, Jinja "
                "file or bundled model name; or use the dialect the upstream speaks (prefill, prefix-flag, "
                "continue-final-message)"
            )
        if self.template and not (self.continuation == "completions" and self.tokenizer != "device"):
            raise ValueError(
                "template is read only with continuation='completions' and a tokenizer other than the device's"
            )
        if self.token_id_prompts and self.tokenizer != "device":
            raise ValueError("token_id_prompts needs tokenizer='device' (the ids are the device model's)")
        if self.gateway_template and "structured_output" in self.model_fields_set:
            if self.structured_output in ("native", "json_object"):
                raise ValueError(
                    "structured_output='native' needs a chat upstream (a completions upstream with the device's "
                    "tokenizer is given tools in the prompt; set 'gbnf' if it enforces a GBNF grammar, else 'none')"
                )
        elif self.structured_output == "gbnf" and not self.gateway_template:
            raise ValueError(
                "structured_output='gbnf' needs continuation='completions' with tokenizer='device' (the grammar goes "
                "with the gateway's rendered prompt)"
            )
        return self

    @property
    def gbnf(self) -> bool:
        """Whether the upstream is sent GBNF grammars: set so, or the embedded llama-cpp-python server by default."""
        if "structured_output" in self.model_fields_set:
            return self.structured_output == "gbnf"
        return self.embedded is not None and self.gateway_template


class EmbeddedWorkerSettings(_Strict):
    """A HAT worker (`tandem worker`) the gateway starts on loopback and stops with itself."""

    port: Annotated[int, Field(ge=0, le=65535)] = 0
    num_threads: Annotated[int, Field(ge=1)] | None = None
    cpus: list[int] | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where the worker computes (see app/worker/server.py)
    # Profile the prefill cost tau at start-up ([worker] prefill_profile); None = the worker's default.
    prefill_profile: bool | None = None
    startup_timeout: Annotated[float, Field(gt=0)] = 300.0


class HATCloudSettings(HATOptions):
    """A HAT cloud endpoint: the device half runs here (first m layers, head, adapter), the worker hosts the middle
    layers; only hidden states cross the network. The device half's knobs are HATOptions' (clients/hat/options.py:
    their defaults, rules and meaning); these settings are handed to the backend as they are. Here only what the
    gateway itself decides: which model and adapter files, an embedded worker, the price, the vocabulary."""

    kind: Literal["hat"]
    model: str = "qwen2.5-coder-0.5b-instruct"  # bundled name or GGUF path; the model the worker splits
    adapter: str = ""  # a trained adapter (safetensors); "" = the shipped one for this model, if any
    # Reduced draft vocabulary (JSON from `tandem train-adapter --save-draft-vocab`): "" = the one shipped with
    # the shipped adapter, if any; "full" = draft over the whole vocabulary; or a path.
    draft_vocab: str = ""
    # "device": the split model shares the device model's vocabulary (the bundled Qwen pair does),
    # so prompts and migrations go by token ids.
    tokenizer: Literal["device", "own"] = "device"
    stall_timeout: Annotated[float, Field(gt=0)] | None = None  # as [device]'s: unset, [gateway] stall_timeout
    # Failures before the first token (429, 5xx, a refused connection; policies/breaker.py): tried again up to
    # `retries` times after a backoff from `retry_backoff_seconds` (doubling, with jitter) or the upstream's
    # Retry-After, waiting at most `retry_budget_seconds` in all; `failures_to_open` in a row cool the cloud for
    # `cooldown_seconds`, doubling with each opening up to `max_cooldown_seconds` (a Retry-After: that long).
    retries: Annotated[int, Field(ge=0, le=10)] = 2
    retry_backoff_seconds: Annotated[float, Field(ge=0)] = 0.25
    retry_budget_seconds: Annotated[float, Field(ge=0)] = 4.0
    failures_to_open: Annotated[int, Field(ge=1)] = 3
    cooldown_seconds: Annotated[float, Field(gt=0)] = 1.0
    max_cooldown_seconds: Annotated[float, Field(gt=0)] = 60.0
    price: PriceSettings = PriceSettings()
    # A profile (HATOptions.profile) also reaches an embedded worker, which starts from its measured times.
    embedded: EmbeddedWorkerSettings | None = None
    co_located: bool | None = None  # as [clouds.x] co_located for an OpenAI-compatible cloud

    @property
    def shares_device(self) -> bool:
        """Whether the worker computes on the device's own hardware (`co_located`, else whether it is embedded)."""
        return self.co_located if self.co_located is not None else self.embedded is not None

    @model_validator(mode="after")
    def _one_worker(self) -> HATCloudSettings:
        if self.embedded is not None and (self.worker_urls or self.worker_registry):
            raise ValueError(
                "worker_urls / worker_registry and an [embedded] worker contradict each other: a pool, or one embedded"
            )
        if self.embedded is not None and "worker_url" in self.model_fields_set:
            raise ValueError(
                "worker_url and an [embedded] worker contradict each other: the gateway would start its own worker "
                "and ignore worker_url. Remove the embedded table to use the worker at worker_url, or worker_url to "
                "use the embedded one"
            )
        return self


def _cloud_kind(value) -> str:
    kind = value.get("kind", "openai") if isinstance(value, dict) else getattr(value, "kind", "openai")
    return kind if kind in ("openai", "hat") else "openai"


AnyCloud = Annotated[
    Annotated[CloudSettings, Tag("openai")] | Annotated[HATCloudSettings, Tag("hat")],
    Discriminator(_cloud_kind),
]


class EmbeddingSettings(_Strict):
    """POST /v1/embeddings on the device (loaded at the first request)."""

    enabled: bool = True
    model: Literal["all-minilm-l6-v2"] = "all-minilm-l6-v2"  # the bundled sentence-embedding model
    max_tokens: Annotated[int, Field(gt=0, le=512)] = 256  # longer inputs are truncated (the model's window)


class TelemetrySettings(_Strict):
    """OpenTelemetry traces over OTLP/HTTP (app/serving/telemetry.py): off unless enabled; needs the `telemetry`
    extra. What is unset here comes from the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, _HEADERS, ...)."""

    enabled: bool = False
    endpoint: str = ""  # the OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces
    service_name: str = "tandem-gateway"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TANDEM_", env_nested_delimiter="__", extra="forbid")

    gateway: GatewaySettings = GatewaySettings()
    device: DeviceSettings = DeviceSettings()
    clouds: dict[str, AnyCloud] = {}
    disco: DiscoSettings = DiscoSettings()
    embeddings: EmbeddingSettings = EmbeddingSettings()
    state: StateSettings = StateSettings()
    telemetry: TelemetrySettings = TelemetrySettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The TOML file arrives as init kwargs; the environment must win over it.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _budget_knobs_valid(self) -> Settings:
        try:
            budget_from_config(self)
        except BudgetValidationError as exc:
            raise ValueError(exc.message) from None
        return self

    @model_validator(mode="after")
    def _cloud_exists(self) -> Settings:
        needs_cloud = declaration(self.gateway.policy).needs_cloud
        if self.gateway.cloud not in self.clouds and (needs_cloud or self.clouds):
            known = ", ".join(self.clouds) or "none configured"
            raise ValueError(f"gateway.cloud names {self.gateway.cloud!r}, which is not in [clouds] ({known})")
        return self


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = list(e["loc"])
        if len(loc) > 2 and loc[0] == "clouds" and loc[2] in ("openai", "hat"):
            del loc[2]  # the union's tag, not a field the user wrote
        where = ".".join(str(p) for p in loc) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {msg}" + (f" (got {e['input']!r})" if e["type"] != "missing" and _short(e) else ""))
    return "invalid configuration:\n" + "\n".join(lines)


def _short(e: dict) -> bool:
    return isinstance(e.get("input"), str | int | float | bool) and len(repr(e["input"])) < 80


def _read_toml(path: str | Path | None) -> dict:
    if path is None:
        return {}
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def embedded_default() -> Path:
    """The embedded default config, shipped with the code (deploy/embedded.toml): what `tandem serve` runs without
    --config."""
    return Path(str(resources.files("deploy") / "embedded.toml"))


def load_settings(path: str | Path | None = None) -> Settings:
    data = _read_toml(path)
    data.pop("worker", None)  # the worker's own table (WorkerConfig): one file may configure both processes
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


class WorkerConfig(BaseSettings):
    """`tandem worker`'s settings tree, with the gateway's conventions (a [worker] table, TANDEM_WORKER__FIELD
    variables, errors naming `worker.field`). A root of its own: a worker needs no gateway or cloud, which `Settings`
    requires, and a gateway's file may hold a [worker] table for the worker beside it without the gateway reading it."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", env_nested_delimiter="__", extra="forbid")

    worker: WorkerSettings = WorkerSettings()


# The device token reaches a worker through its environment only (a command line is visible to everyone): the
# tree's own variable, or the shorter one README has always given.
WORKER_TOKEN_VARIABLES = ("TANDEM_WORKER__AUTH_TOKEN", "TANDEM_WORKER_AUTH_TOKEN")


def load_worker_settings(path: str | Path | None = None, flags: Mapping[str, Any] | None = None) -> WorkerSettings:
    """The worker's settings: the TOML file's [worker] table; over it the environment (TANDEM_WORKER__FIELD, and
    TANDEM_WORKER_AUTH_TOKEN for the token); over both the command line's `flags` (a None value: not given)."""
    table = _read_toml(path).get("worker", {})
    if not isinstance(table, dict):
        raise ConfigError(f"invalid configuration:\n  worker: must be a table, got {type(table).__name__}")
    environment = EnvSettingsSource(WorkerConfig)().get("worker", {})
    tokens = {os.environ[name] for name in WORKER_TOKEN_VARIABLES if os.environ.get(name)}
    if len(tokens) > 1:
        raise ConfigError(f"invalid configuration:\n  worker.auth_token: {' and '.join(WORKER_TOKEN_VARIABLES)} differ")
    if tokens:
        environment = {**environment, "auth_token": tokens.pop()}
    given = {name: value for name, value in (flags or {}).items() if value is not None}
    try:
        # Validated once, whole: a flag may make a combination valid that the file or the environment alone is not.
        # model_validate, not WorkerConfig(...): the environment is merged already, under the flags.
        return WorkerConfig.model_validate({"worker": {**table, **environment, **given}}).worker
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
