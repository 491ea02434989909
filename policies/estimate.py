"""Live estimators behind DiSCo's decisions: what the gateway has observed, as distributions.

Why these and not predictors: the paper (§3, App. C) finds server TTFT
unpredictable per request (moving average / XGBoost predictions miss by 20-50%)
but stable as a distribution, while device TTFT is a straight line in prompt
length. So the gateway keeps:

* `EmpiricalTTFT`   — a rolling window of one cloud backend's TTFTs: the CDF F,
                       its inverse (quantiles) and the raw samples for Alg. 2.
* `DeviceTTFTLine`  — T_d(l) = k·l + c by least squares over (l, ttft) pairs,
                       refined online with exponential forgetting.
* `PromptLengths`   — a rolling window of prompt lengths: p(l) for Eq. 3 / Alg. 2.
* `OutputLengths`   — observed answer lengths: expected remaining tokens given how
                       many were already delivered (Eq. 4's l_remaining).
* `MovingAverage` / `MigrationTimes` — t_m for the token buffer B = r_c·t_m (Eq. 6).
* `CloudPromptCaches` — what each cloud's prompt cache is expected to hold of a conversation's next prompt: the
                       context last sent there for that conversation, times how much of such a re-sent prefix the
                       cloud's usage reports have shown as cached.

Caches: a prefix an endpoint holds is not prefilled again, so the device's line is fitted on, and asked with, the
tokens it *evaluates* after those it holds (its cache index says which, exactly). A cloud that computes on the
device's own cores (co-located) is priced as a multiple of that line (`cloud_pace`: its TTFT over the line's for the
same work), over the tokens its own prompt cache is expected not to hold.

Every estimator has a prior, so the gateway can decide before the first sample:
distribution estimators blend prior pseudo-samples with real samples until
`min_samples` real ones exist; the line starts from prior coefficients carried as
two weighted pseudo-points; moving averages start at their prior value.

All of this is pure (no clocks, no I/O): callers pass observations in.
Windows are numpy ring buffers so handing 100K samples to a policy costs no copy.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

# Priors. Chosen to be plausible for a chat gateway, deliberately broad; the
# simulator documents where its (different) synthetic parameters come from.
PRIOR_SERVER_TTFT_MEDIAN = 0.5  # s: commercial APIs' typical TTFT (App. C scale: 0.2-1.4 s)
PRIOR_SERVER_TTFT_SIGMA = 0.6  # log-space spread: wide, so w_tail starts conservative
PRIOR_PROMPT_MEDIAN = 48  # tokens: a short chat turn plus template
PRIOR_PROMPT_SIGMA = 0.8
PRIOR_DEVICE_K = 1 / 80.0  # s/token: ~80 tok/s prefill (§5.1, Xiaomi 14 + Qwen1.5-0.5B)
PRIOR_DEVICE_C = 0.05  # s: one forward pass for the first token
PRIOR_OUTPUT_MEDIAN = 100  # tokens
PRIOR_OUTPUT_SIGMA = 0.7
PRIOR_PSEUDO_SAMPLES = 64
CO_LOCATED_MIN_SAMPLES = 3  # a co-located cloud's first tokens before its pace is trusted
DEFAULT_HISTORY_WEIGHT = 0.8  # a moving average's weight of history (HAT's alpha)


def lognormal_quantiles(median: float, sigma: float, n: int = PRIOR_PSEUDO_SAMPLES) -> np.ndarray:
    """n evenly spaced quantiles (midpoints) of a log-normal: deterministic prior pseudo-samples."""
    z = np.array([NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)])
    return median * np.exp(sigma * z)


def inverse_cdf(samples: np.ndarray, p: float) -> float:
    """F^{-1}(p) of the empirical CDF: the smallest sample x with F(x) ≥ p.

    This (not an interpolated quantile) is what budget arithmetic needs: with
    w = F^{-1}(1 − q), the share of samples above w is at most q. O(n) by
    partition, no full sort. p ≤ 0 gives the minimum.
    """
    n = samples.shape[0]
    if n == 0:
        raise ValueError("inverse_cdf of an empty sample")
    k = min(n - 1, max(0, math.ceil(p * n - 1e-9) - 1))
    return float(np.partition(samples, k)[k])


class RingBuffer:
    """Fixed-capacity window of the most recent values, numpy-backed.

    `values()` returns a view of the filled part in storage order (not arrival
    order): distributions do not care, and no copy is made.
    """

    def __init__(self, capacity: int, dtype: type = np.float64) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._buf = np.empty(capacity, dtype=dtype)
        self._next = 0
        self._n = 0
        self.version = 0  # bumps on every change; lets callers cache derived values

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return self._buf.shape[0]

    def add(self, value: float) -> None:
        self._buf[self._next] = value
        self._next = (self._next + 1) % self._buf.shape[0]
        if self._n < self._buf.shape[0]:
            self._n += 1
        self.version += 1

    def extend(self, values: Iterable[float]) -> None:
        arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=self._buf.dtype)
        cap = self._buf.shape[0]
        if arr.shape[0] >= cap:
            self._buf[:] = arr[-cap:]
            self._next, self._n = 0, cap
        else:
            idx = (self._next + np.arange(arr.shape[0])) % cap
            self._buf[idx] = arr
            self._next = int((self._next + arr.shape[0]) % cap)
            self._n = min(cap, self._n + arr.shape[0])
        self.version += 1

    def values(self) -> np.ndarray:
        return self._buf[: self._n]


class _Distribution:
    """Rolling empirical distribution with a prior used until `min_samples` real samples exist."""

    def __init__(self, prior: np.ndarray, window: int, min_samples: int, dtype: type) -> None:
        self._window = RingBuffer(window, dtype)
        self._prior = np.asarray(prior, dtype=dtype)
        self.min_samples = min_samples
        self._sorted: np.ndarray | None = None
        self._sorted_version = -1

    @property
    def count(self) -> int:
        """Number of real samples in the window."""
        return len(self._window)

    def add(self, value: float) -> None:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"sample must be a finite non-negative number, got {value!r}")
        self._window.add(value)

    def extend(self, values: Iterable[float]) -> None:
        arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64)
        if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
            raise ValueError("samples must be finite non-negative numbers")
        self._window.extend(arr)

    def samples(self) -> np.ndarray:
        """What policies consume: the real window, blended with the prior while it is small."""
        real = self._window.values()
        if len(real) >= self.min_samples:
            return real
        if len(real) == 0:
            return self._prior
        return np.concatenate([self._prior, real])

    def _sorted_samples(self) -> np.ndarray:
        # samples() is a function of the window's content only (the prior is fixed).
        if self._sorted is None or self._sorted_version != self._window.version:
            self._sorted = np.sort(self.samples())
            self._sorted_version = self._window.version
        return self._sorted

    def cdf(self, x: float) -> float:
        """F(x) = share of samples ≤ x."""
        s = self._sorted_samples()
        return float(np.searchsorted(s, x, side="right")) / s.shape[0]

    def quantile(self, p: float) -> float:
        """Inverse CDF (smallest sample with F ≥ p); see `inverse_cdf`."""
        s = self._sorted_samples()
        n = s.shape[0]
        return float(s[min(n - 1, max(0, math.ceil(p * n - 1e-9) - 1))])

    inverse_cdf = quantile

    def mean(self) -> float:
        return float(np.mean(self.samples()))


class EmpiricalTTFT(_Distribution):
    """One cloud backend's server TTFT distribution (seconds), rolling window.

    Feed it every observed cloud TTFT. In a race the loser is cancelled; letting
    the cloud stream reach its first token before closing it costs nothing extra
    (its prompt is billed either way) and keeps this sample uncensored.
    """

    def __init__(
        self,
        window: int = 2000,
        min_samples: int = 20,
        prior_median: float = PRIOR_SERVER_TTFT_MEDIAN,
        prior_sigma: float = PRIOR_SERVER_TTFT_SIGMA,
    ) -> None:
        super().__init__(lognormal_quantiles(prior_median, prior_sigma), window, min_samples, np.float64)


class PromptLengths(_Distribution):
    """Prompt-length distribution p(l), rolling window of token counts."""

    def __init__(
        self,
        window: int = 5000,
        min_samples: int = 20,
        prior_median: float = PRIOR_PROMPT_MEDIAN,
        prior_sigma: float = PRIOR_PROMPT_SIGMA,
    ) -> None:
        prior = np.maximum(1, np.rint(lognormal_quantiles(prior_median, prior_sigma))).astype(np.int64)
        super().__init__(prior, window, min_samples, np.int64)


class OutputLengths(_Distribution):
    """Observed answer lengths (tokens): the expected remaining length for migration (Eq. 4).

    `expected_remaining(i)` is the mean residual E[L − i | L > i] — conditioned on
    the answer having already reached i tokens, which matters because answers that
    are still going are the long ones.
    """

    def __init__(
        self,
        window: int = 5000,
        min_samples: int = 20,
        prior_median: float = PRIOR_OUTPUT_MEDIAN,
        prior_sigma: float = PRIOR_OUTPUT_SIGMA,
    ) -> None:
        prior = np.maximum(1, np.rint(lognormal_quantiles(prior_median, prior_sigma))).astype(np.int64)
        super().__init__(prior, window, min_samples, np.int64)
        self._suffix: np.ndarray | None = None
        self._suffix_of: np.ndarray | None = None

    def expected_remaining(self, delivered: int, max_tokens: int | None = None) -> float:
        """E[L − delivered | L > delivered], capped by what max_tokens still allows.

        0 when no observed answer was ever that long: unknown gain never justifies
        paying a migration.
        """
        s = self._sorted_samples()
        if self._suffix_of is not s:
            # suffix[j] = sum of s[j:], so the mean of the samples above index j is cheap.
            self._suffix = np.concatenate([np.cumsum(s[::-1])[::-1], [0]]).astype(np.float64)
            self._suffix_of = s
        j = int(np.searchsorted(s, delivered, side="right"))
        above = s.shape[0] - j
        if above == 0:
            return 0.0
        remaining = self._suffix[j] / above - delivered
        if max_tokens is not None:
            remaining = min(remaining, max(0, max_tokens - delivered))
        return float(remaining)


PAIRS_UNIT = 1e6  # attention pairs are counted in millions in the fit (keeps its normal equations well scaled)
PAIRS_PRIOR_LENGTH = 4096  # the context term is held to its prior like one pseudo-point of a prompt this long


def attention_pairs(tokens: float, held: float = 0.0) -> float:
    """The (query, key) pairs the attention of `tokens` new positions computes after `held` positions already in the
    KV cache: each new position attends to every one before it and to itself."""
    return tokens * held + tokens * (tokens + 1) / 2


class DeviceTTFTLine:
    """T_d(n | h) = c + k·n + q·a(n, h), weighted least squares, refined online (§4.2's line, with its context term).

    n: the tokens the endpoint evaluates (its prompt less the prefix it holds in a cache), h: the tokens it holds,
    a(n, h) = n·h + n(n+1)/2: the attention pairs those n positions compute. The paper's line is k·n + c; on long
    prompts the attention term is what grows (a 0.5B model on 2 CPU cores: 4.4 ms a token plus 1.5 µs a pair, so a
    token at position 15,000 costs 27 ms, six times one at the start), and a line fitted through a long prompt's
    sample would miss both ends (a short prompt at a negative time, a warm turn's new tokens at the average price).
    q's prior is 0 (the plain line) until samples long enough to show it arrive. Also the TTFT line of a cloud
    co-located with the device.

    Sufficient statistics make each update O(1). `decay` < 1 forgets old samples
    exponentially (device speed drifts with thermal state and background load).
    The prior enters as two pseudo-points on the prior line of `prior_weight` each,
    and q is held to its prior as strongly as one pseudo-point of PAIRS_PRIOR_LENGTH
    tokens; they age like real samples but never below `prior_floor` of their weight,
    so the fit stays defined when every real sample has the same length, without
    pulling a well-observed line.
    """

    def __init__(
        self,
        k: float = PRIOR_DEVICE_K,
        c: float = PRIOR_DEVICE_C,
        *,
        q: float = 0.0,
        prior_weight: float = 0.5,
        prior_lengths: tuple[float, float] = (16.0, 512.0),
        decay: float = 0.995,
        prior_floor: float = 1e-4,
        pairs_weight: float | None = None,
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self._prior_matrix = np.zeros((3, 3))
        self._prior_vector = np.zeros(3)
        for x in prior_lengths:
            f = self._features(x, 0.0)
            self._prior_matrix += prior_weight * np.outer(f, f)
            self._prior_vector += prior_weight * f * (c + k * x + q * attention_pairs(x))
        scale = attention_pairs(PAIRS_PRIOR_LENGTH) / PAIRS_UNIT
        held_to = (prior_weight if pairs_weight is None else pairs_weight) * scale * scale  # q's pull to its prior
        self._prior_matrix[2, 2] += held_to
        self._prior_vector[2] += held_to * q * PAIRS_UNIT
        self._prior_scale = 1.0
        self._prior_floor = prior_floor
        self._matrix = np.zeros((3, 3))  # Σw·f·fᵀ over f = (1, n, a / PAIRS_UNIT)
        self._vector = np.zeros(3)  # Σw·f·t
        self.count = 0
        self._refit()

    @staticmethod
    def _features(tokens: float, held: float) -> np.ndarray:
        return np.array([1.0, tokens, attention_pairs(tokens, held) / PAIRS_UNIT])

    @classmethod
    def fit(
        cls, lengths: Iterable[float], ttfts: Iterable[float], *, decay: float = 1.0, held: Iterable[float] = ()
    ) -> DeviceTTFTLine:
        """Least squares through (n, ttft) samples (n evaluated after `held` tokens, 0 each by default): no prior, but
        the attention term held to 0 where the samples leave it open (too short, or all of one length)."""
        line = cls(prior_weight=0.0, decay=decay, pairs_weight=1e-9)
        lengths = list(lengths)
        for x, t, h in zip(lengths, ttfts, list(held) or [0.0] * len(lengths), strict=True):
            line.add(x, t, held=h)
        return line

    def add(self, length: float, ttft: float, held: float = 0.0) -> None:
        """A first token `ttft` seconds after the start of a prefill of `length` tokens that followed `held` tokens
        taken from a cache."""
        if length < 0 or held < 0 or not math.isfinite(ttft) or ttft < 0:
            raise ValueError(f"bad device TTFT sample length={length!r} held={held!r} ttft={ttft!r}")
        f = self._features(length, held)
        self._matrix *= self.decay
        self._vector *= self.decay
        self._matrix += np.outer(f, f)
        self._vector += f * ttft
        self._prior_scale = max(self._prior_floor, self._prior_scale * self.decay)
        self.count += 1
        self._refit()

    def _refit(self) -> None:
        matrix = self._matrix + self._prior_scale * self._prior_matrix
        vector = self._vector + self._prior_scale * self._prior_vector
        # The normal equations, each column scaled to a unit diagonal first (n and a(n, h) are nearly collinear over
        # short prompts, and differ by orders of magnitude); the least-norm solution where they are degenerate.
        scale = 1.0 / np.sqrt(np.maximum(np.diag(matrix), 1e-300))
        scaled = matrix * np.outer(scale, scale)
        try:
            solution = np.linalg.solve(scaled, vector * scale)
        except np.linalg.LinAlgError:
            solution = np.linalg.lstsq(scaled, vector * scale, rcond=None)[0]
        c, k, q = solution * scale
        self.c, self.k, self.q = float(c), float(k), float(q) / PAIRS_UNIT

    def predict(self, length: float, held: float = 0.0) -> float:
        """Expected TTFT (s) for a prefill of `length` tokens after `held` tokens taken from a cache; never negative."""
        return max(0.0, self.c + self.k * length + self.q * attention_pairs(length, held))

    __call__ = predict


@dataclass
class MovingAverage:
    """x ← alpha·x + (1 − alpha)·sample: `alpha` is the weight of history (HAT Eq. 1's form, also DiSCo's t_m).

    `value` is a prior the first sample is averaged with; without one the first sample initialises the average
    (no bias toward an arbitrary zero start).
    """

    alpha: float = DEFAULT_HISTORY_WEIGHT
    value: float | None = None
    count: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha (the weight of history) must be in [0, 1), got {self.alpha}")

    def update(self, sample: float) -> float:
        sample = float(sample)
        self.value = sample if self.value is None else self.alpha * self.value + (1 - self.alpha) * sample
        self.count += 1
        return self.value

    def get(self, default: float = 0.0) -> float:
        return default if self.value is None else self.value


class MigrationTimes:
    """t_m per migration target: moving average of observed migration times (s).

    Observed = from the moment the source stops to the target's first new token.
    The prior for a target is the caller's best guess (e.g. the cloud's median
    TTFT, or the device line at the expected prompt + answer length).
    """

    def __init__(self, prior: float = 1.0, weight: float = 0.2) -> None:
        self._prior = prior
        self._weight = weight
        self._by_target: dict[str, MovingAverage] = {}

    def _get(self, target: str, prior: float | None) -> MovingAverage:
        ma = self._by_target.get(target)
        if ma is None:
            ma = self._by_target[target] = MovingAverage(1 - self._weight, self._prior if prior is None else prior)
        return ma

    def add(self, target: str, seconds: float) -> None:
        self._get(target, None).update(seconds)

    def estimate(self, target: str, prior: float | None = None) -> float:
        """Current t_m for `target`; `prior` seeds it if nothing was observed yet."""
        ma = self._by_target.get(target)
        if ma is None or ma.count == 0:
            return self._prior if prior is None else prior
        return ma.get()


class CloudPromptCaches:
    """What each cloud's prompt cache is expected to hold of a conversation's next prompt.

    A provider that caches prompts (OpenAI, Anthropic, DeepSeek, llama-server) keeps the prefix a request sent it for
    a while, and a later request of the same conversation (the same `prompt_cache_key`) reads it back. So per cloud
    and conversation this keeps the context last sent there (`held`, the device's tokens), and per cloud how much of
    such a re-sent prefix its usage reports showed as cached (`reliability`: the share reported over the share
    expected, learned from each report on a conversation that had sent the cloud a prefix before; 0 until one shows
    any — a cloud that reports no cached tokens, llama-cpp-python's server, is planned as holding nothing).
    A request without a conversation key falls back on the cloud's overall share of cached prompt tokens.
    Conversations are kept least recently used first out, `conversations` per cloud."""

    def __init__(self, conversations: int = 4096) -> None:
        self.conversations = conversations
        self._held: dict[str, OrderedDict[str, int]] = {}
        self._reliability: dict[str, MovingAverage] = {}
        self._share: dict[str, MovingAverage] = {}  # every report's cached share, whatever its conversation

    def observe(
        self,
        cloud: str,
        conversation: str | None,
        context_tokens: int,
        reported_prompt: int = 0,
        reported_cached: int = 0,
    ) -> None:
        """A cloud attempt was sent `context_tokens` (ours) of `conversation` and, when it reported its usage, billed
        `reported_prompt` prompt tokens (its own), `reported_cached` of them read from its prompt cache."""
        if reported_prompt > 0:
            share = min(reported_cached, reported_prompt) / reported_prompt
            self._share.setdefault(cloud, MovingAverage()).update(share)
            expected = self.held(cloud, conversation, context_tokens) / context_tokens if context_tokens > 0 else 0.0
            if expected > 0:
                self._reliability.setdefault(cloud, MovingAverage()).update(min(1.0, share / expected))
        if conversation is not None and context_tokens > 0:
            held = self._held.setdefault(cloud, OrderedDict())
            held[conversation] = context_tokens
            held.move_to_end(conversation)
            while len(held) > self.conversations:
                held.popitem(last=False)

    def held(self, cloud: str, conversation: str | None, context_tokens: int) -> int:
        """The leading tokens of a `context_tokens` context of `conversation` sent to `cloud` before (0: none)."""
        sent = self._held.get(cloud, {}).get(conversation) if conversation is not None else None
        return 0 if sent is None else min(sent, context_tokens)

    def reliability(self, cloud: str) -> float:
        average = self._reliability.get(cloud)
        return 0.0 if average is None else average.get()

    def share(self, cloud: str) -> float:
        """The share of its prompts `cloud`'s usage reports showed as cached, over every conversation (0 until one)."""
        average = self._share.get(cloud)
        return 0.0 if average is None else average.get()

    def expected(self, cloud: str, conversation: str | None, context_tokens: int) -> float:
        """The tokens of a `context_tokens` context that `cloud` is expected to take from its prompt cache (and bill
        at its cached price): the conversation's prefix it was sent before, as far as its reports show it keeps such
        prefixes; without a conversation key, the cloud's overall share."""
        if conversation is None:
            return self.share(cloud) * context_tokens
        return self.reliability(cloud) * self.held(cloud, conversation, context_tokens)

    def describe(self, cloud: str) -> dict:
        return {
            "conversations": len(self._held.get(cloud, ())),
            "reliability": self.reliability(cloud),
            "cached_share": self.share(cloud),
        }


class Estimators:
    """Everything DiSCo's policies read, for one gateway: one place to feed and to query."""

    def __init__(self, *, window: int = 2000) -> None:
        self.window = window
        self.server_ttft: dict[str, EmpiricalTTFT] = {}
        self.device_ttft = DeviceTTFTLine()
        # Per cloud co-located with the device: its TTFT over the device line's for the same prefill (it computes on
        # the device's own cores, so its first token comes at a multiple of the device's time for the same work).
        self.cloud_pace: dict[str, MovingAverage] = {}
        self.prompt_lengths = PromptLengths(window=window)
        self.output_lengths = OutputLengths(window=window)
        self.migration_times = MigrationTimes()
        self.prompt_caches = CloudPromptCaches()

    def observe_prompt_cache(
        self,
        backend: str,
        prompt_tokens: int,
        cached_tokens: int,
        conversation: str | None = None,
        context_tokens: int | None = None,
    ) -> None:
        """A cloud's usage report: `prompt_tokens` billed, `cached_tokens` of them from its prompt cache; for a
        request of `conversation` that was sent `context_tokens` of ours (None: its own count stands in)."""
        context = prompt_tokens if context_tokens is None else context_tokens
        self.prompt_caches.observe(backend, conversation, context, prompt_tokens, cached_tokens)

    def cached_share(self, backend: str) -> float:
        """The share of a prompt `backend`'s provider billed as cached, over all its reports (0 until one)."""
        return self.prompt_caches.share(backend)

    def server(self, backend: str) -> EmpiricalTTFT:
        """The TTFT distribution of one cloud backend (created with the prior on first use)."""
        est = self.server_ttft.get(backend)
        if est is None:
            est = self.server_ttft[backend] = EmpiricalTTFT(window=self.window)
        return est

    def observe_co_located(self, backend: str, tokens: float, held: float, seconds: float) -> None:
        """A co-located cloud's first token `seconds` after the start of its prefill of `tokens` after `held`."""
        device = self.device_ttft.predict(tokens, held)
        if device > 0:
            self.cloud_pace.setdefault(backend, MovingAverage()).update(seconds / device)

    def co_located_ttft(self, backend: str, tokens: float, held: float = 0.0) -> float | None:
        """A co-located cloud's expected TTFT for `tokens` evaluated after `held`: the device line's times its pace;
        None until it has been measured (CO_LOCATED_MIN_SAMPLES first tokens)."""
        pace = self.cloud_pace.get(backend)
        if pace is None or pace.count < CO_LOCATED_MIN_SAMPLES:
            return None
        return pace.get() * self.device_ttft.predict(tokens, held)
