"""What a HATBackend (clients/hat/device.py) is told and what it counts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from clients.hat import wire
from clients.hat.link import LinkProfile
from policies.drafting import DEFAULT_ETA
from policies.jupiter import ChunkCost


@dataclass(frozen=True)
class HATOptions:
    """How a HATBackend is set up (the gateway builds it from a HAT cloud's settings, app/config.py).

    worker_url: ws://host:port (WebSocket at /v1/hidden/ws; a full ws URL with a path is used as is) or
        http://host:port (POST + SSE).
    gguf_path: the bundled model's GGUF (loaded through clients.hf_model, cached) — or give the backend a loaded
        model + tokenizer. Must be the model the worker splits (checked: hidden size, layer count, m).
    adapter_path: a trained adapter (safetensors, clients.hat.adapter.Adapter.save); None = untrained adapter
        initialised from layer m's attention (correct output, low accept length).
    draft_vocab_path: a reduced draft vocabulary (JSON {"token_ids": [...]}, `tandem train-adapter
        --save-draft-vocab`): drafts are chosen among these tokens (plus the end tokens) only, so a draft step's
        LM head multiplies a few thousand rows instead of the whole vocabulary. Verification always uses the
        full head, so the output is unchanged (greedy) or still exactly the LLM's distribution (sampling: the
        draft distribution is simply zero outside the subset). None = draft over the full vocabulary.
    auth_token: the worker's token (sent as "Authorization: Bearer ...").
    wire_dtype: "float32" | "float16" — must match the worker's dtype.
    eta, max_draft, include_low_confidence: the drafting stop rule (Eq. 5). speculative=False: plain U-shape
        (one token per round, no drafting) — the baseline HAT is compared against.
    draft_length: how long each round's draft is (policies.drafting.DraftLengthController). "eta": until the
        confidence falls below eta, at most max_draft (HAT's rule); "eq7": exactly l* drafts, l* = argmax over
        1..max_draft of Eq. 7's expected tokens per verification over the modelled round time (measured draft
        step, link bandwidths and latency, the worker's g(mu + l + 1) kept current by its STATUS frames, device
        head); "eq7+eta": the confidence stop with l* as its cap. Output is the same under all three (greedy:
        token for token; sampling: in distribution) — only the speed changes.
    parallel_drafting: while the worker verifies, draft ahead from the top `parallel_candidates` alternatives to
        the last draft token, for as many steps as Eq. 6 says fit in the round trip (and never past the reply);
        when the verified correction is one of them, the next round starts with that branch's drafts ready.
    tree_width: verify a token tree of this many positions (the last accepted token + tree_width - 1 drafts over
        the draft head's top-k) in greedy rounds (clients/hat/tree.py); 0 = chains (the draft_length rule). Rounds
        that sample, penalise, follow a grammar or return logprobs stay chains. Greedy output is unchanged.
    tree_paths: the tree's shape as rank paths (e.g. ((0,), (1,), (0, 0)): top-1, top-2, top-1 after top-1), as
        ARCA chose it from a profile; None = shaped greedily from policies.trees' prior for tree_width nodes.
    arca: with a profile, verify the token tree (or the chain) that the profile's ARCA choice names (Ghidorah's
        width chosen from replayed acceptance and profiled step times); overrides tree_width / tree_paths.
    chunking: "eq3" = equal chunks of Eq. 3's size; "dp" = Jupiter's sequence partition over the device → link →
        worker pipeline (policies/jupiter.py plan_device_prefill), with the device's own prefill step time fitted
        at load, the measured upload bandwidth and the worker's prefill τ(x | y) from its OPEN reply (its g when
        it sends none): unequal chunks (the three stages are very unequal, where one chunk size is not optimal).
        A fixed chunk_size overrides both.
    chunk_size: fixed prefill chunk; None = Eq. 3 with min_chunk..max_chunk.
    beta_up / beta_down: initial link bandwidth estimates in bytes/s (HAT's devices measure them, e.g. with
        iperf3); the upload estimate is refined from prefill timings. With a LinkProfile the emulated
        bandwidths are the initial estimates.
    link: a LinkProfile to emulate latency / jitter / bandwidth on this device's send and receive paths.
    noise: Gaussian noise added to every hidden-state frame the device sends (prefill chunks and drafts), std =
        noise x each vector's RMS (clients/hat/noise.py): makes inverting the states harder (`tandem bench
        privacy`), at a cost in quality — with noise > 0 the output is no longer the LLM's exactly. 0 = none.
    drafting: "batched" (default): concurrent streams' device work — draft steps, verification heads, prefill
        chunks — runs batched at the drafting station (clients/hat/station.py), streams grouped by SD-edge's Alg. 1
        and pipelined against the worker; each stream's output is what it would be alone. "solo": each stream's
        own model calls, one at a time.
    profile: a profile of this device and its worker (`tandem profile`, clients/hat/profile.py): the draft-length
        controller starts from its measured draft step, head, link latency and replayed acceptance, and the
        bandwidth estimates from its measured bandwidths, instead of the warm-up priors; refused if it was made
        for another model or m. None = today's online estimates only.
    noise_seed: seeds every session's noise generator (reproducible tests and benchmarks only: the same noise in
        every session can be subtracted out); None = a fresh seed from the OS per session.
    """

    worker_url: str
    gguf_path: str | os.PathLike[str] | None = None
    name: str = "hat"
    model_id: str | None = None
    m: int = 2
    adapter_path: str | os.PathLike[str] | None = None
    draft_vocab_path: str | os.PathLike[str] | None = None
    auth_token: str | None = None
    wire_dtype: str = "float32"
    eta: float = DEFAULT_ETA
    max_draft: int = 8
    include_low_confidence: bool = True
    draft_length: str = "eta"  # "eta" | "eq7" | "eq7+eta"
    speculative: bool = True
    parallel_drafting: bool = False
    parallel_candidates: int = 3
    tree_width: int = 0
    tree_paths: tuple[tuple[int, ...], ...] | None = None
    arca: bool = False
    drafting: str = "batched"  # "batched" | "solo"
    chunking: str = "eq3"  # "eq3" | "dp"
    chunk_size: int | None = None
    min_chunk: int = 16
    max_chunk: int = 256
    beta_up: float = 10e6
    beta_down: float = 15e6
    link: LinkProfile | None = None
    noise: float = 0.0
    noise_seed: int | None = None
    profile: str | os.PathLike[str] | None = None
    connect_timeout: float = 10.0
    round_timeout: float = 60.0
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES
    cache_root: str | os.PathLike[str] | None = None
    num_threads: int | None = None


@dataclass
class HATStats:
    """Cumulative counters of one HATBackend (all streams)."""

    sessions: int = 0
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
    verify_seconds: float = 0.0  # device: head over the deep states + acceptance
    bytes_up: int = 0
    bytes_down: int = 0
    parallel_steps: int = 0  # batched parallel-drafting steps run while waiting for the worker
    parallel_hits: int = 0  # rounds whose draft came ready-made from parallel drafting
    draft_cap_sum: int = 0  # sum over rounds of the draft cap used (max_draft under "eta", else l*)
    status_updates: int = 0  # STATUS frames (the worker's mu and g) received mid-session
    tree_rounds: int = 0  # rounds that verified a token tree
    last_chunk_size: int = 0
    last_chunks: list[int] = field(default_factory=list)  # the last prefill's chunk lengths
    # chunking = "dp": the worker stage's τ(x | y) the last plan used (its prefill_tau, or g when it sent none)
    last_worker_tau: ChunkCost | None = None

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
            "mean_draft_cap": self.draft_cap_sum / r,
            "status_updates": self.status_updates,
            "tree_rounds": self.tree_rounds,
        }
