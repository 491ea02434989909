"""HAT drafting rules (Eqs. 1-2, 5, 6) and the speculation-length model (Eq. 7).

Why these are separate small pieces: the device half, the worker engine and
the trace simulator all need the same decisions. Everything here is pure:
plain numbers in, plain values out, no clocks (delays are arguments, in
seconds) and no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from policies.estimate import DEFAULT_HISTORY_WEIGHT

DEFAULT_ETA = 0.6  # HAT's drafting confidence threshold


# --- state monitoring (Eqs. 1-2) ------------------------------------------------------------------


@dataclass
class DelayPredictor:
    """The cloud's predictive function g(x): compute delay (s) of a batch of x tokens (HAT Eq. 2).

    Eq. 2 updates g at the observed batch size: g^t(mu) = alpha * g^{t-1}(mu) + (1 - alpha) * eta_hat. To predict
    at sizes never observed (Eq. 3 asks for g(mu + X)), we fit g(x) = slope * x + intercept by exponentially
    weighted least squares with the same forgetting factor alpha: every observation's weight is multiplied by alpha
    per update, the new one gets (1 - alpha), and the first observation starts with weight 1 (as MovingAverage
    does, so it is not pulled toward zero). At a single batch size this is exactly the Eq. 2 recursion. Until two
    distinct sizes have been seen the slope is `prior_slope` (linear runtime T(b) = c1*b + c2 is the usual shape
    on accelerators and CPUs).
    """

    alpha: float = DEFAULT_HISTORY_WEIGHT
    prior_slope: float = 0.0
    _w: float = 0.0
    _wx: float = 0.0
    _wy: float = 0.0
    _wxx: float = 0.0
    _wxy: float = 0.0
    count: int = field(default=0)

    def update(self, batch_tokens: float, delay: float) -> None:
        a, b = (self.alpha, 1.0 - self.alpha) if self.count else (0.0, 1.0)  # first sample initialises
        x, y = float(batch_tokens), float(delay)
        self._w = a * self._w + b
        self._wx = a * self._wx + b * x
        self._wy = a * self._wy + b * y
        self._wxx = a * self._wxx + b * x * x
        self._wxy = a * self._wxy + b * x * y
        self.count += 1

    def coefficients(self) -> tuple[float, float]:
        """(slope, intercept) of the current fit; (prior_slope, 0) before any observation."""
        if self._w <= 0:
            return self.prior_slope, 0.0
        mx, my = self._wx / self._w, self._wy / self._w
        var = self._wxx / self._w - mx * mx
        degenerate = var <= 1e-9 * max(1.0, mx * mx)  # one batch size seen so far: no slope information
        slope = self.prior_slope if degenerate else (self._wxy / self._w - mx * my) / var
        return slope, my - slope * mx

    def __call__(self, batch_tokens: float) -> float:
        slope, intercept = self.coefficients()
        return max(0.0, slope * batch_tokens + intercept)


# --- drafting stop rule (Eq. 5) ---------------------------------------------------------------------


@dataclass(frozen=True)
class DraftStopRule:
    """Stop drafting once the draft token's max softmax probability falls below eta (Eq. 5), or at max_draft.

    `include_low_confidence`: HAT's parallel drafting assumes the low-confidence token is the last one of the
    draft (it is sent and likely corrected); set False to stop *before* it instead.
    """

    eta: float = DEFAULT_ETA
    max_draft: int = 8
    include_low_confidence: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"eta must be in [0, 1], got {self.eta}")
        if self.max_draft < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_draft}")

    def decide(self, max_prob: float, drafted: int) -> tuple[bool, bool]:
        """Given the new token's max probability and how many drafts were kept before it: (keep_it, stop_now)."""
        if drafted >= self.max_draft:
            return False, True
        if max_prob < self.eta:
            return self.include_low_confidence, True
        return True, drafted + 1 >= self.max_draft


def should_stop_drafting(max_prob: float, drafted: int, eta: float = DEFAULT_ETA, max_draft: int = 8) -> bool:
    """Eq. 5 as a predicate: stop after the token with `max_prob`, `drafted` tokens already in the draft incl. it."""
    return max_prob < eta or drafted >= max_draft


# --- parallel drafting (Eq. 6) ----------------------------------------------------------------------


def parallel_draft_steps(
    *,
    draft_len: int,
    token_bytes: float,
    beta_up: float,
    beta_down: float,
    g_mu: float,
    gamma: float,
    max_steps: int | None = None,
) -> int:
    """lambda_i = floor((mu_i*A/beta_up + g(mu) + mu_i*A/beta_down) / gamma_i)   (Eq. 6).

    How many draft steps the device can run ahead (from the top-k candidates) while its draft of `draft_len` tokens
    is uploaded, computed by the cloud (g_mu seconds) and the deep states come back; gamma = one drafting step (s).
    """
    if beta_up <= 0 or beta_down <= 0 or gamma <= 0:
        raise ValueError("bandwidths and gamma must be positive")
    window = draft_len * token_bytes / beta_up + g_mu + draft_len * token_bytes / beta_down
    steps = max(0, math.floor(window / gamma + 1e-12))
    return steps if max_steps is None else min(steps, max_steps)


# --- speculation length (Eq. 7) and acceptance ------------------------------------------------------


def expected_tokens_per_verification(alpha: float, draft_len: int) -> float:
    """L = (1 - alpha^(l+1)) / (1 - alpha): tokens gained per verification with i.i.d. acceptance alpha (Eq. 7).

    Counts the accepted drafts plus the one token the verifier always contributes; alpha = 1 gives l + 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if draft_len < 0:
        raise ValueError(f"draft_len must be >= 0, got {draft_len}")
    if alpha >= 1.0 - 1e-12:
        return float(draft_len + 1)
    return (1.0 - alpha ** (draft_len + 1)) / (1.0 - alpha)


def best_draft_length(
    alpha: float,
    draft_step: float,
    verify_time: Callable[[int], float] | float,
    max_len: int = 16,
) -> int:
    """The draft length l in [1, max_len] maximising tokens per second L(l) / (l*draft_step + verify_time(l)).

    Ties go to the shorter draft (less wasted work when acceptance drifts down).
    """
    if max_len < 1:
        raise ValueError("max_len must be >= 1")
    verify = verify_time if callable(verify_time) else (lambda _l: float(verify_time))
    best_l, best_rate = 1, -1.0
    for length in range(1, max_len + 1):
        cost = length * draft_step + verify(length)
        rate = expected_tokens_per_verification(alpha, length) / cost if cost > 0 else math.inf
        if rate > best_rate * (1 + 1e-12):
            best_l, best_rate = length, rate
    return best_l


@dataclass
class AcceptanceEstimator:
    """Online i.i.d. acceptance rate: alpha_hat = sum(accepted) / (sum(accepted) + rejecting rounds).

    A round that accepts its whole draft adds no rejection. `prior` pseudo-counts keep early estimates sane.
    """

    prior_accepted: float = 4.0
    prior_rejections: float = 1.0
    accepted: float = 0.0
    rejections: float = 0.0

    def update(self, accepted: int, drafted: int) -> float:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}, {drafted}")
        self.accepted += accepted
        if accepted < drafted:
            self.rejections += 1
        return self.alpha

    @property
    def alpha(self) -> float:
        a = self.accepted + self.prior_accepted
        r = self.rejections + self.prior_rejections
        return a / (a + r) if a + r > 0 else 0.0
