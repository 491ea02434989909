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

Every estimator has a prior, so the gateway can decide before the first sample:
distribution estimators blend prior pseudo-samples with real samples until
`min_samples` real ones exist; the line starts from prior coefficients carried as
two weighted pseudo-points; moving averages start at their prior value.

All of this is pure (no clocks, no I/O): callers pass observations in.
Windows are numpy ring buffers so handing 100K samples to a policy costs no copy.
"""

from __future__ import annotations

import math
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


class DeviceTTFTLine:
    """T_d(l) = k·l + c, weighted least squares, refined online (§4.2).

    Sufficient statistics make each update O(1). `decay` < 1 forgets old samples
    exponentially (device speed drifts with thermal state and background load).
    The prior enters as two pseudo-points on the prior line of `prior_weight` each;
    they age like real samples but never below `prior_floor` of their weight, so
    the fit stays defined when every real sample has the same length, without
    pulling a well-observed line.
    """

    def __init__(
        self,
        k: float = PRIOR_DEVICE_K,
        c: float = PRIOR_DEVICE_C,
        *,
        prior_weight: float = 0.5,
        prior_lengths: tuple[float, float] = (16.0, 512.0),
        decay: float = 0.995,
        prior_floor: float = 1e-4,
    ) -> None:
        if not 0 < decay <= 1:
            raise ValueError("decay must be in (0, 1]")
        self.decay = decay
        self._prior = np.zeros(5)
        for x in prior_lengths:
            self._prior += prior_weight * np.array([1.0, x, x * x, k * x + c, x * (k * x + c)])
        self._prior_scale = 1.0
        self._prior_floor = prior_floor
        self._data = np.zeros(5)  # Σw, Σw·l, Σw·l², Σw·t, Σw·l·t
        self.count = 0
        self._refit()

    @classmethod
    def fit(cls, lengths: Iterable[float], ttfts: Iterable[float], *, decay: float = 1.0) -> DeviceTTFTLine:
        """Least-squares line through (l, ttft) samples; the prior gets a negligible weight."""
        line = cls(prior_weight=1e-9, decay=decay)
        for x, t in zip(lengths, ttfts, strict=True):
            line.add(x, t)
        return line

    def add(self, length: float, ttft: float) -> None:
        if length < 0 or not math.isfinite(ttft) or ttft < 0:
            raise ValueError(f"bad device TTFT sample length={length!r} ttft={ttft!r}")
        self._data *= self.decay
        self._data += np.array([1.0, length, length * length, ttft, length * ttft])
        self._prior_scale = max(self._prior_floor, self._prior_scale * self.decay)
        self.count += 1
        self._refit()

    def _refit(self) -> None:
        sw, sl, sll, st, slt = self._data + self._prior_scale * self._prior
        det = sw * sll - sl * sl
        if det <= 1e-12 * max(1.0, sw * sll):
            self.k, self.c = 0.0, st / sw if sw > 0 else 0.0
        else:
            self.k = (sw * slt - sl * st) / det
            self.c = (st - self.k * sl) / sw

    def predict(self, length: float) -> float:
        """Expected device TTFT (s) for a prompt of `length` tokens; never negative."""
        return max(0.0, self.k * length + self.c)

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


class Estimators:
    """Everything DiSCo's policies read, for one gateway: one place to feed and to query."""

    def __init__(self, *, window: int = 2000) -> None:
        self.window = window
        self.server_ttft: dict[str, EmpiricalTTFT] = {}
        self.device_ttft = DeviceTTFTLine()
        self.prompt_lengths = PromptLengths(window=window)
        self.output_lengths = OutputLengths(window=window)
        self.migration_times = MigrationTimes()
        # Per cloud: the share of the prompt tokens it billed that its provider read from its prompt cache (the
        # usage it reports), i.e. how much of a re-sent prefix is expected at the cached-input price.
        self.prompt_cache: dict[str, MovingAverage] = {}

    def observe_prompt_cache(self, backend: str, prompt_tokens: int, cached_tokens: int) -> None:
        if prompt_tokens > 0:
            share = min(cached_tokens, prompt_tokens) / prompt_tokens
            self.prompt_cache.setdefault(backend, MovingAverage()).update(share)

    def cached_share(self, backend: str) -> float:
        """The share of a prompt `backend`'s provider is expected to bill as cached (0 until it reports one)."""
        average = self.prompt_cache.get(backend)
        return 0.0 if average is None else average.get()

    def server(self, backend: str) -> EmpiricalTTFT:
        """The TTFT distribution of one cloud backend (created with the prior on first use)."""
        est = self.server_ttft.get(backend)
        if est is None:
            est = self.server_ttft[backend] = EmpiricalTTFT(window=self.window)
        return est
