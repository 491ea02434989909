"""What a HATBackend (clients/hat/device.py) is told and what it counts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from clients.hat.link import LinkProfile
from policies.drafting import DEFAULT_ETA
from policies.sequence_partition import ChunkCost


class HATOptions(BaseModel):
    """How a HATBackend (clients/hat/device.py) runs: the device half's knobs, each with its one default and its rule.

    A HAT cloud's settings (app/config.py's HATCloudSettings) are these plus the gateway's own fields, and the gateway
    hands them to the backend as they are; a test or benchmark builds them directly. What the backend runs (the
    model, its adapter and draft vocabulary, its name) is given to HATBackend itself.

    worker_url: ws://host:port (WebSocket at /v1/hidden/ws; a full ws URL with a path is used as is) or
        http://host:port (POST + SSE). worker_urls: several such workers, a pool (clients/hat/pool.py): each session
        goes to the one with the lowest predicted delay and moves to another if its worker is lost mid-answer
        (empty: worker_url alone, unless worker_registry names a store whose live workers make the pool). They
        share one auth_token.
    auth_token: the worker's token (sent as "Authorization: Bearer ...").
    m: the device's input layers (the worker holds m..n-1 and checks it).
    wire_dtype: "float32" | "float16" — must match the worker's dtype.
    eta, max_draft, include_low_confidence: the drafting stop rule (Eq. 5). eta 0: no confidence stop (every round
        drafts its cap). speculative=False: plain U-shape (one token per round, no drafting) — the baseline HAT is
        compared against.
    draft_length: how long each round's draft is (policies.drafting.DraftLengthController). "eta": until the
        confidence falls below eta, at most max_draft (HAT's rule); "eq7": exactly l* drafts, l* = argmax over
        1..max_draft of Eq. 7's expected tokens per verification over the modelled round time (measured draft
        step, link bandwidths and latency, the worker's g(mu + l + 1) kept current by its STATUS frames, device
        head); "eq7+eta": the confidence stop with l* as its cap. Output is the same under all three (greedy:
        token for token; sampling: in distribution) — only the speed changes.
    parallel_drafting: while the worker verifies, draft ahead from the top `parallel_candidates` alternatives to
        the last draft token, for as many steps as Eq. 6 says fit in the round trip (and never past the reply);
        when the verified correction is one of them, the next round starts with that branch's drafts ready.
    proactive_drafting: while the worker verifies, draft the next round as if it accepted every draft (SpecEdge's
        proactive drafting): the draft head's guess for the token after the last draft, then drafts after it, until
        the stop rule ends them or the reply arrives; the next round starts with them when verification accepted all
        and added that very token, else they are dropped. Before parallel drafting's branches when both are on.
        Both draft ahead in greedy rounds without a grammar only (a sampled draft ahead would draw from the
        request's seeded generator as often as the reply's timing allows: seeded runs would not repeat), and at the
        station only while it serves this one stream. No output changes. Off by default: on this box's CPU worker
        both together cut a round ~2 % for ~110 ms of device work a round, and a fast worker's reply would wait on
        the step in progress (BENCHMARKS.md, "Drafting ahead, measured again", session 23).
    tree_width: verify a token tree of this many positions (the last accepted token + tree_width - 1 drafts over
        the draft head's top-k) in greedy rounds (clients/hat/tree.py); 0 = chains (the draft_length rule). Rounds
        that sample, penalise, follow a grammar or return logprobs stay chains. Greedy output is unchanged. Faster
        where the worker's pass costs about the same for w positions as for a chain's.
    lookup_tokens: in greedy chain rounds, verify beside the drafted chain at most this many tokens copied from the
        context (prompt lookup, policies/lookup.py: what followed the latest earlier occurrence of the context's last
        1-3 tokens), as a branch of a tree leaving the chain where the two part (clients/hat/rounds.py); a round
        accepts whichever goes further. 0 = off. Needs a worker that verifies trees; rounds that sample, penalise,
        follow a grammar or return logprobs stay plain chains. Greedy output is unchanged.
    tree_paths: the tree's shape as rank paths (e.g. ((0,), (1,), (0, 0)): top-1, top-2, top-1 after top-1), as
        ARCA chose it from a profile; None = shaped greedily from policies.trees' prior for tree_width nodes.
    arca: with a profile, run the verification shape the profile's ARCA choice names (Ghidorah's width chosen from
        replayed acceptance and profiled step times; clients/hat/profile.py, ArcaChoice): a chain of width w drafts
        w - 1 tokens a round, the fixed chain ARCA modelled (replacing max_draft; under draft_length "eq7" /
        "eq7+eta", l* and that mode's confidence stop act within the cap), a tree is verified in greedy rounds
        (max_draft raised to its depth if need be); overrides tree_width / tree_paths.
    draft_precision: "int8": the drafting-only weights — the draft head's rows and the adapter's projections — run
        as weight-only int8 with bfloat16 activations (clients/hat/quant.py; ~4× cheaper a draft-head row on an
        AVX-512 CPU, the same draft picks at ~99% of positions); "fp32": as the model stores them. Verification and
        the input layers are fp32 either way, so the output is the same under both (greedy: token for token).
    head_precision: "int8": picks that read only the head's argmax (greedy, no penalties, grammar or logprobs) take
        it from int8 scores of every row, the rows that can still win under a bound on the int8 error recomputed in
        fp32 (clients/hat/quant.py ArgmaxHead: the fp32 argmax exactly, checked against this CPU's kernel at load);
        every other pick, and "fp32", computes the whole head in fp32. Greedy output is the same under both.
    drafting: "batched": concurrent streams' device work — draft steps, verification heads, prefill chunks — runs
        batched at the drafting station (clients/hat/station.py), streams grouped by SD-edge's Alg. 1 and
        pipelined against the worker; each stream's output is what it would be alone. "solo": each stream's own
        model calls, one at a time.
    draft_step_rows: how the station's draft steps (a row per stream, through the input layers) project their rows,
        both batch-invariant (clients/hat/ragged.py): "each" row on its own (a matrix-vector product: a device's one
        or two streams at a time cost what the solo path costs, ~2.2x less than a chunk; each further stream adds a
        row's cost), "chunked" in fixed 4-row chunks (one chunk's cost for up to four streams at once; measured no
        faster than "each" at four streams, slower at one: BENCHMARKS.md, the drafting station).
    chunking: "eq3" = equal chunks of Eq. 3's size; "dp" = Jupiter's sequence partition over the device → link →
        worker pipeline (policies/sequence_partition.py plan_device_prefill), with the device's own prefill step
        time fitted at load, the measured upload bandwidth and the worker's prefill τ(x | y) from its OPEN reply (its
        g when it sends none): unequal chunks (the three stages are very unequal, where one chunk size is not optimal).
        A fixed chunk_size overrides both.
    chunk_size: fixed prefill chunk; None = Eq. 3 with min_chunk..max_chunk.
    beta_up / beta_down: initial link bandwidth estimates in bytes/s (HAT's devices measure them, e.g. with
        iperf3); the upload estimate is refined from prefill timings. With a link profile the emulated
        bandwidths are the initial estimates.
    link: a LinkProfile (or its spec, e.g. "latency=20ms,jitter=2ms,up=10MB/s,down=15MB/s"; "" = none) to emulate
        latency / jitter / bandwidth on this device's send and receive paths.
    noise: Gaussian noise added to every hidden-state frame the device sends (prefill chunks and drafts), std =
        noise x each vector's RMS (clients/hat/noise.py): makes inverting the states harder (`tandem bench
        privacy`), at a cost in quality — with noise > 0 the output is no longer the LLM's exactly. 0 = none.
    noise_seed: seeds every session's noise generator (reproducible tests and benchmarks only: the same noise in
        every session can be subtracted out); None = a fresh seed from the OS per session.
    profile: a profile of this device and its worker (`tandem profile`, clients/hat/profile.py): the draft-length
        controller starts from its measured draft step, head, link latency and replayed acceptance, and the
        bandwidth estimates from its measured bandwidths, instead of the warm-up priors; refused if it was made
        for another model or m. "" = today's online estimates only.
    connect_timeout, round_timeout: seconds to open a session, and for the worker to answer a frame.
    max_frame_bytes: the largest frame the device accepts; None = the wire's default (clients/hat/wire.py; not
        imported here, so that the settings load without torch).
    num_threads: torch intra-op threads of the device half (None: torch's default, one per core). In the gateway
        it shares the process with the llama.cpp device model, which decodes ~25% slower beside torch's default
        even while HAT is idle (BENCHMARKS.md, device decode speed); HAT's own benchmarks run it on one thread.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    worker_url: str = "ws://127.0.0.1:8100"
    # A pool of workers (clients/hat/pool.py): sessions placed by predicted delay, moved on a worker's loss.
    # Empty: worker_url alone.
    worker_urls: tuple[str, ...] = ()
    # A registry of workers in a shared store (Redis-protocol URL; app/worker/registry.py announces them), and its
    # key prefix: its live workers join the pool. "" = none.
    worker_registry: str = ""
    worker_registry_prefix: str = "tandem:"
    auth_token: SecretStr | None = None
    m: Annotated[int, Field(ge=1)] = 2
    wire_dtype: Literal["float32", "float16"] = "float32"
    eta: Annotated[float, Field(ge=0, lt=1)] = DEFAULT_ETA
    max_draft: Annotated[int, Field(ge=1, le=64)] = 8
    include_low_confidence: bool = True
    draft_length: Literal["eta", "eq7", "eq7+eta"] = "eta"
    speculative: bool = True
    parallel_drafting: bool = False
    proactive_drafting: bool = False
    parallel_candidates: Annotated[int, Field(ge=1)] = 3
    tree_width: Annotated[int, Field(ge=0, le=64)] = 0
    lookup_tokens: Annotated[int, Field(ge=0, le=16)] = 4
    tree_paths: tuple[tuple[int, ...], ...] | None = None
    arca: bool = False
    draft_precision: Literal["int8", "fp32"] = "int8"
    head_precision: Literal["int8", "fp32"] = "int8"
    drafting: Literal["batched", "solo"] = "batched"
    draft_step_rows: Literal["each", "chunked"] = "each"
    chunking: Literal["eq3", "dp"] = "eq3"
    chunk_size: Annotated[int, Field(ge=1)] | None = None
    min_chunk: Annotated[int, Field(ge=1)] = 16
    max_chunk: Annotated[int, Field(ge=1)] = 256
    beta_up: Annotated[float, Field(gt=0)] = 10e6
    beta_down: Annotated[float, Field(gt=0)] = 15e6
    link: LinkProfile | None = None
    noise: Annotated[float, Field(ge=0, le=10)] = 0.0
    noise_seed: int | None = None
    profile: str | Path = ""
    connect_timeout: Annotated[float, Field(gt=0)] = 10.0
    round_timeout: Annotated[float, Field(gt=0)] = 60.0
    max_frame_bytes: Annotated[int, Field(ge=4096)] | None = None
    num_threads: Annotated[int, Field(ge=1)] | None = 1

    @field_validator("worker_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value.startswith(("ws://", "wss://", "http://", "https://")):
            raise ValueError(f"must start with ws://, wss://, http:// or https://, got {value!r}")
        return value.rstrip("/")

    @field_validator("worker_urls")
    @classmethod
    def _urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        urls = tuple(cls._url(v) for v in value)
        if len(set(urls)) != len(urls):
            raise ValueError("names a worker twice")
        return urls

    @field_validator("tree_width")
    @classmethod
    def _tree_width(cls, value: int) -> int:
        if value in (1, 2):
            raise ValueError("a token tree needs at least 3 positions (0 = chains; 2 positions is a 1-draft chain)")
        return value

    @field_validator("link", mode="before")
    @classmethod
    def _link(cls, value: object) -> object:
        if isinstance(value, str):
            return LinkProfile.parse(value) if value else None
        return value

    @model_validator(mode="after")
    def _arca_needs_a_profile(self) -> HATOptions:
        if self.arca and not self.profile:
            raise ValueError("arca chooses the verification tree from a profile: set profile (tandem profile) too")
        return self


@dataclass
class HATStats:
    """Cumulative counters of one HATBackend (all streams)."""

    sessions: int = 0
    failovers: int = 0  # sessions moved to another worker of the pool mid-answer (clients/hat/pool.py)
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    prefill_seconds: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    round_tokens: int = 0  # tokens produced by rounds: accepted drafts + one LLM token each
    round_seconds: float = 0.0
    draft_seconds: float = 0.0  # device: input submodel + adapter + head while drafting
    wait_seconds: float = 0.0  # send -> deep states back (link + worker)
    verify_seconds: float = 0.0  # device: head over the deep states + acceptance, rollback, adoption
    # The rounds' profile (round_profile): of draft_seconds, the input layers'; of verify_seconds, the verification
    # head's (+ acceptance); of wait_seconds, the link's (modelled: LinkModel.round_trip_seconds, at most the wait)
    input_seconds: float = 0.0
    head_seconds: float = 0.0
    link_seconds: float = 0.0
    ahead_seconds: float = 0.0  # device drafting done while a round waited (parallel / proactive drafting)
    bytes_up: int = 0
    bytes_down: int = 0
    parallel_steps: int = 0  # batched parallel-drafting steps run while waiting for the worker
    parallel_hits: int = 0  # rounds whose draft came ready-made (parallel or proactive drafting)
    proactive_steps: int = 0  # proactive drafting's steps run while waiting for the worker
    proactive_hits: int = 0  # rounds whose proactive branch was adopted (all accepted, the guess right)
    proactive_misses: int = 0  # rounds whose proactive branch was dropped (a rejection, or a wrong guess)
    draft_cap_sum: int = 0  # sum over rounds of the draft cap used (max_draft under "eta", else l*)
    longest_draft: int = 0  # the most drafts a chain round sent
    status_updates: int = 0  # STATUS frames (the worker's mu and g) received mid-session
    tree_rounds: int = 0  # rounds that verified a token tree (lookup rounds included)
    lookup_rounds: int = 0  # chain rounds verified with a lookup branch beside the chain (policies/lookup.py)
    lookup_accepted: int = 0  # of the accepted drafts, the lookup branches'
    last_chunk_size: int = 0
    last_chunks: list[int] = field(default_factory=list)  # the last prefill's chunk lengths
    # chunking = "dp": the worker stage's τ(x | y) the last plan used (its prefill_tau, or g when it sent none)
    last_worker_tau: ChunkCost | None = None

    def add_round(
        self, draft_s: float, wait_s: float, verify_s: float, input_s: float, head_s: float, link_s: float
    ) -> None:
        """A round's times: drafting (of it, input_s in the input layers), the wait from send to reply (of it, the
        link's modelled share link_s, at most the wait: the rest is the worker's), verification (of it, head_s in
        the head and acceptance). The round's count is the caller's."""
        self.draft_seconds += draft_s
        self.wait_seconds += wait_s
        self.verify_seconds += verify_s
        self.round_seconds += draft_s + wait_s + verify_s
        self.input_seconds += input_s
        self.head_seconds += head_s
        self.link_seconds += min(link_s, wait_s)

    def summary(self) -> dict[str, float]:
        r = max(self.rounds, 1)
        return {
            "rounds": self.rounds,
            "accept_length": self.round_tokens / r,  # tokens per verification round (accepted + 1)
            "accepted_per_round": self.accepted / r,
            "drafted_per_round": self.drafted / r,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "ms_per_round": 1e3 * self.round_seconds / r,
            "draft_ms_per_round": 1e3 * self.draft_seconds / r,
            "wait_ms_per_round": 1e3 * self.wait_seconds / r,
            "verify_ms_per_round": 1e3 * self.verify_seconds / r,
            "prefill_seconds": self.prefill_seconds,
            "parallel_hits": self.parallel_hits,
            "parallel_steps": self.parallel_steps,
            "proactive_steps": self.proactive_steps,
            "proactive_hits": self.proactive_hits,
            "proactive_misses": self.proactive_misses,
            "mean_draft_cap": self.draft_cap_sum / r,
            "longest_draft": self.longest_draft,
            "status_updates": self.status_updates,
            "tree_rounds": self.tree_rounds,
            "lookup_rounds": self.lookup_rounds,
            "lookup_accepted": self.lookup_accepted,
            "profile_ms_per_round": round_profile(self),
        }


PROFILE_PARTS = ("input", "drafts", "head", "link", "worker", "other")


def round_profile(stats: HATStats) -> dict[str, float | str]:
    """Where a round's time went, ms per round: the device's input layers and the rest of drafting (adapter, draft
    head), the verification head, the link and the worker (the wait minus the link's modelled share), and the
    rest of the round (rollback, adoption, hand-offs between the event loop and the model thread). The parts sum
    to ms_per_round; `bottleneck` names the largest, `device` sums the device's parts, `ahead` is drafting the
    device did inside the wait (not part of the sum)."""
    r = max(stats.rounds, 1)
    parts = {
        "input": stats.input_seconds,
        "drafts": stats.draft_seconds - stats.input_seconds,
        "head": stats.head_seconds,
        "link": stats.link_seconds,
        "worker": stats.wait_seconds - stats.link_seconds,
        "other": stats.verify_seconds - stats.head_seconds,
    }
    out: dict[str, float | str] = {k: 1e3 * v / r for k, v in parts.items()}
    out["device"] = 1e3 * (parts["input"] + parts["drafts"] + parts["head"] + parts["other"]) / r
    out["ahead"] = 1e3 * stats.ahead_seconds / r
    out["bottleneck"] = max(PROFILE_PARTS, key=lambda k: parts[k]) if stats.rounds else ""
    return out
