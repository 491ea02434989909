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

    def prime(self, points: list[tuple[float, float]]) -> None:
        """Start from measured (batch tokens, delay) points (a profile) instead of nothing: the least-squares line
        through them, held with the weight of one observation, so live passes take over at Eq. 2's pace."""
        if not points:
            raise ValueError("prime needs at least one (batch_tokens, delay) point")
        n = float(len(points))
        self._w = 1.0
        self._wx = sum(x for x, _ in points) / n
        self._wy = sum(y for _, y in points) / n
        self._wxx = sum(x * x for x, _ in points) / n
        self._wxy = sum(x * y for x, y in points) / n
        self.count = len(points)


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


# --- draft length at run time (Eq. 7 over a measured round time; Eq. 33's enumeration) -----------------

DRAFT_LENGTH_MODES = ("eta", "eq7", "eq7+eta")


def argmax_draft_length(alpha: float, round_time: Callable[[int], float], max_len: int, min_len: int = 1) -> int:
    """l* = argmax over l in [min_len, max_len] of L(l, alpha) / round_time(l) (Eq. 7 over Eq. 33's enumeration).

    Ties (within 1e-12 relative) go to the smaller l: the same rate for less drafting work, and less wasted when
    acceptance drifts down. Eq. 33a keeps l >= 1: a planner that could choose 0 would stop measuring acceptance.
    """
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    best_l, best_rate = min_len, -1.0
    for length in range(min_len, max_len + 1):
        cost = round_time(length)
        rate = expected_tokens_per_verification(alpha, length) / cost if cost > 0 else math.inf
        if rate > best_rate * (1 + 1e-12):
            best_l, best_rate = length, rate
    return best_l


@dataclass(frozen=True)
class LinkState:
    """What the round-time model needs from outside the device: link bandwidths (bytes/s), the bytes of one hidden
    state on the wire, and the worker's mu (tokens per pass) and g(x) = slope*x + intercept (s), as last reported."""

    token_bytes: float
    beta_up: float
    beta_down: float
    mu: float = 0.0
    g: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class RoundTime:
    """T_round(l) by its parts (s): l draft steps, upload of the l+1 rows, the worker's g(mu + l + 1), download of
    their deep states, the device head over the rows it is expected to need, and the link's round-trip latency."""

    draft: float
    upload: float
    worker: float
    download: float
    head: float
    rtt: float

    @property
    def total(self) -> float:
        return self.draft + self.upload + self.worker + self.download + self.head + self.rtt


@dataclass(frozen=True)
class MeasuredParts:
    """A profile's measurements of the round-time parts (`tandem profile`), seconds and bytes/s, and the acceptance
    its offline replay measured: what the controller starts from instead of its priors. None = not measured.

    alpha_chain: acceptance of fixed chains without a confidence stop (what "eq7" plans with); alpha_eta: pooled
    acceptance under the eta stop ("eta"); alpha_confident: acceptance of confident drafts ("eq7+eta").
    weight: how many drafts the replayed acceptance counts as (pseudo-counts of the estimators' priors).
    """

    step: float | None = None
    head_row: float | None = None
    rtt: float | None = None
    alpha_chain: float | None = None
    alpha_eta: float | None = None
    alpha_confident: float | None = None
    weight: float = 20.0


def _prior(alpha: float, weight: float) -> AcceptanceEstimator:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"a measured acceptance rate must be in [0, 1], got {alpha}")
    return AcceptanceEstimator(prior_accepted=alpha * weight, prior_rejections=(1.0 - alpha) * weight)


@dataclass
class DraftLengthController:
    """Chooses each round's draft length l* = argmax L(l, alpha_hat) / T_round(l) from measured parts (HAT item 2).

    Modes: "eta" = HAT's confidence stop (Eq. 5) capped at max_len, no planning; "eq7" = exactly l* drafts (the
    confidence stop off); "eq7+eta" = the confidence stop with l* as its cap. Fed every round's outcome (observe).

    Measured parts (all exponential moving averages, HAT's alpha as the weight of history):
    - step: seconds per draft-model step. A round of l drafts feeds l + 1 tokens through the input submodel and
      adapter (the last accepted token, then each draft) and runs the draft head l times, so draft(l) = (l+1)*step
      with step = draft seconds / (drafts + 1).
    - head_row: seconds of the device head per verified row. Verification runs the head on the first row, and on
      the rest only when the first draft was accepted, so head(l) = head_row * (1 + alpha_hat * l) expected rows.
    - rtt: the round's wait (send to reply) minus the modelled upload, worker compute and download: the link's
      latency plus whatever the model misses (queueing at the worker), clamped at 0.
    - upload / worker / download come from LinkState: (l+1)*A/beta_up, g(mu + l + 1), (l+1)*A/beta_down.

    Where alpha_hat is biased, and the correction. AcceptanceEstimator assumes i.i.d. acceptance; the confidence
    stop breaks that by *selecting* the positions it measures. It stops exactly where the draft model is unsure,
    i.e. where acceptance would be low, so the positions a longer chain would add beyond an eta stop (more
    low-confidence drafts, drafts after an accepted low-confidence one in a hard stretch) are never observed:
    acceptance measured under eta overestimates alpha for a fixed longer chain (with include_low_confidence=False it
    measures confident drafts only). The controller never feeds one regime's measurements into another's plan:
    - "eq7": every round drafts exactly l* with no confidence stop, so the pooled estimate over all drafts is
      measured on the very chains being planned (unselected): it is the alpha Eq. 7 needs.
    - "eq7+eta": l* only matters on rounds that reach it, i.e. whose drafts were all confident (p >= eta; otherwise
      eta stopped earlier). The plan therefore uses the acceptance of confident drafts only (`confident`); the
      pooled rate would mix in the low-confidence last drafts that a binding cap never adds, and plan too short.
    - "eta": nothing is planned; both estimates are kept for the statistics.
    The remaining bias is Eq. 7's own: acceptance is not i.i.d. along a chain (a confident stretch tends to go on).
    """

    mode: str = "eq7+eta"
    max_len: int = 8
    eta: float = DEFAULT_ETA
    pooled: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    confident: AcceptanceEstimator = field(default_factory=AcceptanceEstimator)
    step: float | None = None  # s per draft-model step (None: no measurement yet)
    head_row: float | None = None  # s per head row
    rtt: float | None = None  # s
    weight: float = DEFAULT_HISTORY_WEIGHT  # of history, in the moving averages
    prior_step: float = 5e-3
    prior_head_row: float = 2e-3

    def __post_init__(self) -> None:
        if self.mode not in DRAFT_LENGTH_MODES:
            raise ValueError(f"draft_length must be one of {', '.join(DRAFT_LENGTH_MODES)}, got {self.mode!r}")
        if self.max_len < 1:
            raise ValueError(f"max_draft must be >= 1, got {self.max_len}")

    def seed(self, parts: MeasuredParts) -> None:
        """Start from a profile's measured parts instead of the warm-up priors (before any round is observed);
        the moving averages and the estimators then refine them online as usual."""
        self.step = parts.step if parts.step is not None else self.step
        self.head_row = parts.head_row if parts.head_row is not None else self.head_row
        self.rtt = parts.rtt if parts.rtt is not None else self.rtt
        pooled = parts.alpha_chain if self.mode == "eq7" else parts.alpha_eta
        if pooled is not None:
            self.pooled = _prior(pooled, parts.weight)
        if parts.alpha_confident is not None:
            self.confident = _prior(parts.alpha_confident, parts.weight)

    @property
    def alpha(self) -> float:
        """The acceptance rate the plan uses (see the class docstring for which, and why)."""
        return self.confident.alpha if self.mode == "eq7+eta" else self.pooled.alpha

    def _avg(self, old: float | None, sample: float) -> float:
        return sample if old is None else self.weight * old + (1.0 - self.weight) * sample

    def round_time(self, length: int, link: LinkState) -> RoundTime:
        """T_round(length) from the measured parts and `link` (the worker's latest mu and g)."""
        rows = length + 1
        slope, intercept = link.g
        return RoundTime(
            draft=rows * (self.step if self.step is not None else self.prior_step),
            upload=rows * link.token_bytes / link.beta_up,
            worker=max(0.0, slope * (link.mu + rows) + intercept),
            download=rows * link.token_bytes / link.beta_down,
            head=(self.head_row if self.head_row is not None else self.prior_head_row) * (1 + self.alpha * length),
            rtt=self.rtt or 0.0,
        )

    def plan(self, link: LinkState) -> int:
        """This round's draft cap: max_len under "eta", else l* in [1, max_len]."""
        if self.mode == "eta":
            return self.max_len
        alpha = self.alpha
        return argmax_draft_length(alpha, lambda n: self.round_time(n, link).total, self.max_len)

    def observe(
        self,
        *,
        drafted: int,
        accepted: int,
        confident: list[bool] | None = None,
        draft_s: float | None = None,
        wait_s: float | None = None,
        head_s: float | None = None,
        link: LinkState | None = None,
    ) -> None:
        """One round's outcome: `drafted` drafts of which the first `accepted` were accepted; `confident[i]`: draft
        i's probability was >= eta. Timings are optional (None: not measured this round, e.g. a draft prepared by
        parallel drafting took no drafting time)."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}, {drafted}")
        flags = confident if confident is not None else [True] * drafted
        if len(flags) != drafted:
            raise ValueError(f"{len(flags)} confidence flags for {drafted} drafts")
        if drafted:
            self.pooled.update(accepted, drafted)
            # The confident drafts among the trials: the accepted prefix, and the rejected draft if there was one.
            conf_accepted = sum(flags[:accepted])
            rejected_confident = accepted < drafted and flags[accepted]
            if conf_accepted or rejected_confident:
                self.confident.update(conf_accepted, conf_accepted + int(rejected_confident))
        if draft_s is not None and drafted:
            self.step = self._avg(self.step, draft_s / (drafted + 1))
        if head_s is not None:
            rows = 1 if accepted == 0 else drafted + 1  # the head ran on row 0, then on the rest if it was accepted
            self.head_row = self._avg(self.head_row, head_s / rows)
        if wait_s is not None and link is not None:
            modelled = self.round_time(drafted, link)
            self.rtt = self._avg(self.rtt, max(0.0, wait_s - modelled.upload - modelled.worker - modelled.download))
