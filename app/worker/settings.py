"""The worker's settings: the engine's limits, and the worker section that extends them with the process's own knobs.

`WorkerSettings` is the [worker] section of `tandem worker`'s settings tree; app/config.py's `load_worker_settings`
fills it from a TOML file's [worker] table, TANDEM_WORKER__* environment variables and the command line's flags, and
names a bad value `worker.<field>`. The section lives here, in the worker, and not in app/config.py, because the
worker's modules read it (the engine its limits, the pipeline and the remote stages their stage knobs) and the
worker must not import the composition root that loads it. Pydantic only: app/config.py imports this module, and
the gateway's start-up should not pay for torch to check its settings.

`EngineLimits` are the knobs the engine (app/worker/engine.py) and its scheduler read; `WorkerSettings` inherits
them, so each knob is declared once with its one default, and the section's names stay flat (`[worker]
max_sessions`, `TANDEM_WORKER__MAX_SESSIONS`). The engine takes a `WorkerSettings` as its limits; tests and benchmarks
that build an engine alone give it `EngineLimits`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class EngineLimits(BaseModel):
    """What the engine admits and how it batches: the worker section's engine knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sessions: Annotated[int, Field(ge=1)] = 16
    # Positions per session (capped by the model's max_position_embeddings).
    max_context: Annotated[int, Field(ge=16)] = 4096
    idle_timeout: Annotated[float, Field(gt=0)] = 300.0  # seconds without a frame before a session is dropped
    # Payload bytes of one frame; None: a whole context of hidden states (no frame can carry more positions).
    max_frame_bytes: Annotated[int, Field(ge=4096)] | None = None
    # What one session may have waiting (held behind a sequence gap or queued for the engine thread); a frame past
    # either bound fails alone with 429. None: a context's worth of states plus a quarter (a device has at most its
    # prompt's chunks in flight at once, then one verification round at a time).
    max_session_bytes: Annotated[int, Field(ge=4096)] | None = None
    max_session_frames: Annotated[int, Field(ge=1)] = 256
    # Dtype of hidden states on the wire (both directions). The middle computes in float32 on CPU either way;
    # float16 halves the bytes at a small accuracy cost.
    dtype: Literal["float32", "float16"] = "float32"
    max_batch_tokens: Annotated[int, Field(ge=1)] = 4096  # tokens per forward pass (a single larger frame still runs)
    # Pad a lone 1-token row too, so every row's result is independent of the batch it ran in (bit-identical to
    # running alone). Costs ~1.8x on a lone 1-token forward (plain U-shape decode); HAT rounds send >= 2 tokens.
    batch_invariant: bool = True
    # How pending frames are grouped into passes: "planned" = long prefill frames split into sub-chunks sized from g,
    # and (with max_defer >= 1) the pieces shortest first, grouped by an exact DP for the least mean completion time
    # under the fitted g (policies/worker_batching.py); "greedy" = one frame per session per pass, up to
    # max_batch_tokens (docs/hat.md, "Batching on the worker").
    batching: Literal["planned", "greedy"] = "planned"
    # planned: a sub-chunk spends at most this share of its pass on g's fixed cost.
    subchunk_overhead: Annotated[float, Field(gt=0, lt=1)] = 0.2
    # planned: a frame left out of this many passes in a row goes into the next one. 0 (the default): every session's
    # next piece runs in every pass (a prefill a sub-chunk at a time beside the decode rounds), so the DP reorders
    # nothing and the sub-chunks are the whole effect; 1 lets the DP run short rounds first, which left the
    # prefiller's TTFT at 1.58× greedy's against 1.18× (BENCHMARKS.md, worker batching).
    max_defer: Annotated[int, Field(ge=0)] = 0
    # planned, several sessions: pieces of bulk frames (a flood's drafts, a long prefill the fair share cuts) make a
    # pass they share with frames running whole (other sessions' rounds) at most this many times what it costs
    # without them. None (or a large value, 1000): only the fair quantum bounds them, four fixed costs at the default
    # subchunk_overhead (a flood's rounds 1.5-5.4× their usual time at the median, 9-16× at worst, against 1.0-1.6× and
    # 2.1-10× bounded). A prompt beside decoding sessions may take more passes; measured, its TTFT moved no more than
    # the runs' spread, on a CPU worker or an H100 (BENCHMARKS.md, fair share).
    fair_slowdown: Annotated[float, Field(gt=1)] | None = 2.0
    # A STATUS frame (mu, g) goes with a VERIFY_RESULT when mu, or g's prediction for that round, moved by more than
    # this share since the session was last told (OPEN or an earlier STATUS). 0: with every change.
    status_tolerance: Annotated[float, Field(ge=0)] = 0.1


class WorkerSettings(EngineLimits):
    """The [worker] section: the engine's limits plus what the process needs to load, place and serve the middle."""

    # A bundled model name (see `tandem models`) or a path to a GGUF file; devices must split the same model.
    model: str = "qwen2.5-coder-0.5b-instruct"
    m: Annotated[int, Field(ge=1)] = 2  # decoder layers kept on the device (HAT: < 10% of the layers)
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8100
    # Devices present it as "Authorization: Bearer <token>"; None = no authentication (loopback/dev only).
    auth_token: SecretStr | None = None
    num_threads: Annotated[int, Field(ge=1)] | None = None  # torch intra-op threads (None: torch's default)
    # Where the middle layers compute: "auto" = the first CUDA GPU if torch sees one, else the CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # A profile from `tandem profile` (JSON): g starts from its measured middle-layer times instead of nothing.
    profile: str | None = None
    # Pipeline stages (app/worker/pipeline.py): P processes, each with a contiguous slice of the middle layers chosen
    # by Jupiter's layer partition over per-layer times profiled at start-up; this process is stage 0.
    stages: Annotated[int, Field(ge=1, le=16)] = 1
    stage_threads: list[Annotated[int, Field(ge=1)]] | None = None  # torch threads per stage (None: num_threads)
    # Memory cap per stage (GiB) for the layer partition: a stage's layers' weights plus their KV reserve for
    # max_sessions x max_context must fit. None: no cap (on CUDA each stage is still capped by its free GPU memory).
    stage_memory_gib: list[Annotated[float, Field(gt=0)]] | None = None
    # Stage 0 starts stages 1..P-1 on this host; false: they are started by hand (`--stage-rank s`, across hosts).
    spawn_stages: bool = True
    master_addr: str = "127.0.0.1"  # the stages' rendezvous (stage 0 hosts it)
    master_port: Annotated[int, Field(ge=0, le=65535)] = 0  # 0: a free port (only when stage 0 spawns the stages)
    stage_timeout: Annotated[float, Field(gt=0)] = 300.0  # the longest any stage waits on a peer
    max_inflight: Annotated[int, Field(ge=1)] | None = None  # micro-batches in the pipeline at once (None: P)
    # Start-up timing rounds of every middle layer on every stage (stages in turn; each layer's least time is kept,
    # so a burst of other work on the box does not starve a stage of layers). Fewer: a faster start, a noisier split;
    # 0: no timing, every layer counts the same on every stage (memory caps still apply).
    stage_probe_rounds: Annotated[int, Field(ge=0, le=10)] = 3
    # How stage 0 re-splits a prefill frame for the pipeline: "dp" = Jupiter's sequence partition over the stages'
    # profiled τ(x | y) (exact flow-shop makespan), "equal" = equal pieces (best count), "off" = as the device sent it.
    sequence_partition: Literal["dp", "equal", "paper", "off"] = "dp"
    # Profile the prefill cost τ(x | y) at start-up (app/worker/prefill_cost.py; devices get it at OPEN and plan
    # their chunks with it under chunking = "dp"). None: a staged worker does (its sequence partition needs τ at
    # once), a single-process one does not (several seconds per start on the default model). Either way τ is then
    # fitted from the lone prefill pieces (and chains of drafts) the worker runs.
    prefill_profile: bool | None = None
    # The shared store the worker announces itself in (app/worker/registry.py), for device halves whose HAT endpoint
    # names a registry: a Redis-protocol URL ("" = none), its key prefix, the URL devices should use ("" =
    # ws://host:port), and the heartbeat (the announcement lives three beats).
    registry_url: str = ""
    registry_prefix: str = "tandem:"
    advertise_url: str = ""
    heartbeat_seconds: Annotated[float, Field(gt=0)] = 1.0
    # On SIGTERM (or POST /v1/drain without a timeout) the worker drains: no new sessions, out of the registry, the
    # open sessions run on for up to this many seconds and are then handed over to other workers. A second signal
    # stops at once.
    drain_timeout: Annotated[float, Field(ge=0)] = 30.0

    @model_validator(mode="after")
    def _stages(self) -> WorkerSettings:
        if self.stage_threads is not None and len(self.stage_threads) != self.stages:
            raise ValueError(f"stage_threads needs one value per stage ({self.stages}), got {len(self.stage_threads)}")
        if self.stage_memory_gib is not None and len(self.stage_memory_gib) != self.stages:
            raise ValueError(
                f"stage_memory_gib needs one value per stage ({self.stages}), got {len(self.stage_memory_gib)}"
            )
        if self.stages > 1 and not self.spawn_stages and self.master_port == 0:
            raise ValueError("stages started by hand need a fixed master_port to find stage 0")
        return self
