"""DiSCo migration control (§4.3, Eqs. 4-6): when to move generation, and when to start moving.

Why: the endpoint that wins the first token is often the dearer one to decode
on (the constrained endpoint is fast to start but expensive per token).
Migrating mid-answer saves Δc_decode per remaining token, but the target must
first prefill the prompt plus everything already delivered (no KV transfer) —
less whatever prefix the target still holds in its own KV cache (a device that
lost the first-token race has already prefilled the prompt, and llama.cpp reuses
the longest cached prefix).

    migrate iff  Δc_decode · l_remaining > overhead                         (Eqs. 4-5)
    Δc_decode  = c_source^d − c_target^d   (> 0: only from the dearer endpoint)
    overhead   = c_target^p · (prompt + delivered − cached) + c_target^cached · cached + fixed costs

(`cached` is free on the device — its own KV cache; on a cloud with a prompt cache it is the share the provider
bills at its cached-input price, which is what re-sending the prefix really costs there.)

The switch must not show: the client reads at r_c tokens/s, so token i is due at
t_first + i/r_c (the consumption clock). The source keeps generating until the
client is B = r_c · t_m tokens ahead of that clock (Eq. 6; t_m = expected
migration time), then stops; the buffered B tokens cover the target's prefill.
Tokens that still arrive after their due time are "delayed tokens" (Table 3).

Pure functions of numbers: the gateway calls `should_migrate` after every
delivered token (cheap), the simulator calls the very same function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

READING_RATE = 4.5  # tokens/s: r_c for reading (§2.2: most readers 4-5 tok/s)
SPEECH_RATE = 3.5  # tokens/s: r_c for speech output (3-4 tok/s)


@dataclass(frozen=True)
class MigrationDecision:
    """Outcome of one migration check.

    migrate: Eq. 5 says moving pays (source is the dearer decoder and the saving
    beats the overhead). start_now: it pays *and* the client's lead has reached
    the buffer B, so the source should stop and the target start from the
    delivered prefix now. saving / overhead in the cost model's currency.
    """

    migrate: bool
    start_now: bool
    source: str
    target: str
    saving: float
    overhead: float
    buffer_tokens: float
    lead: float | None
    reason: str


def buffer_tokens(r_c: float, t_m: float) -> float:
    """Eq. 6: B = r_c · t_m tokens the client must be ahead by before the source stops."""
    if r_c <= 0 or t_m < 0:
        raise ValueError(f"need r_c > 0 and t_m ≥ 0, got r_c={r_c!r} t_m={t_m!r}")
    return r_c * t_m


def deadline(i: int, t_first: float, r_c: float) -> float:
    """When the client reaches token i (0-based; token 0 is the first token, shown at t_first)."""
    return t_first + i / r_c


def lead(i_delivered: int, now: float, t_first: float, r_c: float) -> float:
    """How many delivered tokens the client has not read yet at `now` (continuous clock).

    i_delivered tokens delivered so far; the reader has consumed r_c·(now − t_first)
    of them. Negative when the stream is behind the reader (the reader is waiting).
    """
    return i_delivered - r_c * (now - t_first)


def delayed_tokens(delivery_times: np.ndarray | list[float], t_first: float, r_c: float, tol: float = 1e-9) -> int:
    """Tokens delivered after their consumption deadline t_first + i/r_c (Table 3's delay count)."""
    t = np.asarray(delivery_times, dtype=np.float64)
    due = t_first + np.arange(t.shape[0]) / r_c
    return int(np.count_nonzero(t > due + tol))


def should_migrate(
    *,
    source: str,
    target: str,
    source_decode_price: float,
    target_decode_price: float,
    target_prefill_price: float,
    prompt_tokens: int,
    delivered_tokens: int,
    expected_remaining: float,
    cached_tokens: float = 0,
    target_cached_price: float = 0.0,
    fixed_overhead: float = 0.0,
    client_lead: float | None = None,
    buffer: float | None = None,
) -> MigrationDecision:
    """Eqs. 4-6 for one stream at one moment.

    Prices are per token in one currency (λ already applied to the device, see
    `policies.cost.CostModel.prices`). expected_remaining: l_remaining, e.g.
    `OutputLengths.expected_remaining(delivered)`. cached_tokens: how much of prompt +
    delivered the target already holds in its KV cache (or its provider's prompt cache), each at
    target_cached_price (0: a device's own cache costs nothing). client_lead / buffer: the client's
    current lead (see `lead`) and B (see `buffer_tokens`); when both are given,
    `start_now` says whether to begin now.
    """
    delta = source_decode_price - target_decode_price
    context = prompt_tokens + delivered_tokens
    cached = min(max(0.0, cached_tokens), context)
    overhead = target_prefill_price * (context - cached) + target_cached_price * cached + fixed_overhead
    saving = delta * max(0.0, expected_remaining)
    b = math.nan if buffer is None else buffer

    def decision(migrate: bool, start: bool, reason: str) -> MigrationDecision:
        return MigrationDecision(migrate, start, source, target, saving, overhead, b, client_lead, reason)

    if delta <= 0:
        return decision(False, False, "source is not the dearer decoder")
    if not saving > overhead:
        return decision(False, False, "saving does not cover the overhead (Eq. 5)")
    if client_lead is None or buffer is None:
        return decision(True, False, "pays; lead or buffer unknown")
    if client_lead < buffer:
        return decision(True, False, "pays; filling the buffer")
    return decision(True, True, "pays; buffer full, migrate now")
