"""SD-edge (sd-edge-pipeline.txt §II-B to §III): speculative decoding pipelined across two nodes, its batching DP
and its speculation-length search, as pure functions the simulator (`tandem bench sd-edge`) runs.

The model. K tasks (input I_k, output O_k tokens). A draft node drafts l tokens per task per decoding step; a
verify node checks them in one pass and yields L(l, α) = (1 − α^(l+1)) / (1 − α) tokens on average (Eq. 7). Tasks
are split into M batches (padded to the batch's longest input); within a decoding step the batches flow through a
two-stage pipeline, draft then verify, with a barrier between steps (Eqs. 20-22):

    C^d_{n,m} = Σ_{i≤m} T^d_{n,i}      C_{n,m} = max(C^d_{n,m}, C_{n,m−1}) + T^v_{n,m}      T_inf = Σ_n C_{n,M_n}

A pass costs T(b, F) = c1·F·b + c2 seconds (Eq. 17) for b tasks of F FLOPs each. FLOPs come from
`policies.cost.flops_breakdown` (decoder layers only, as the paper counts, but with the gated 3-matrix FFN and
grouped-query attention of the real LLaMA models, and causal attention pairs rather than Eq. 11's full I²).

Where this departs from the printed paper:

* Eq. 29 / Alg. 1 line 15 attach T^d to the wrong term. `plan_batches(variant="corrected")` uses
  Σ_n [max(Υ[j−1,n,0] + T^d_n, Υ[j−1,n,1]) + T^v_n], consistent with Eqs. 20, 31-32; `variant="printed"` keeps
  the printed form (for the regression test and the bench's comparison).
* Alg. 1's backtracking (lines 24-26) packs a batch at every i and never sets S[i] when j* = 1. We set S[i] in
  both branches and jump i ← S[i] − 1.
* The DP is a heuristic: it keeps one completion vector per prefix, which breaks optimal substructure. It is
  tested against brute force within a tolerance, never for equality.
* L is an expectation; N = ceil(O_max / L) and the KV lengths use it as if deterministic (as the paper does).
* The plan is made with O_k = O_max for every task (§III-B); `pipeline_latency` evaluates any plan with the real
  O_k, so planning and evaluation differ, as in the paper.

Everything here is pure: plain numbers and numpy arrays in and out, no clock, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from policies.cost import ModelArch, flops_breakdown
from policies.drafting import expected_tokens_per_verification

# --- Table I and Table II ---------------------------------------------------------------------------------------

# Table I gives layers, hidden and FFN sizes; heads and KV heads are the released checkpoints' (LLaMA-68M: 12
# heads; TinyLlama-1.1B: 32 heads, 4 KV heads; LLaMA-7B/13B: multi-head attention).
LLAMA_68M = ModelArch(n_layers=2, hidden=768, intermediate=3072, n_heads=12, n_kv_heads=12, vocab=32000, name="llama")
LLAMA_1_1B = ModelArch(n_layers=22, hidden=2048, intermediate=5632, n_heads=32, n_kv_heads=4, vocab=32000, name="llama")
LLAMA_7B = ModelArch(n_layers=32, hidden=4096, intermediate=11008, n_heads=32, n_kv_heads=32, vocab=32000, name="llama")
LLAMA_13B = ModelArch(
    n_layers=40, hidden=5120, intermediate=13824, n_heads=40, n_kv_heads=40, vocab=32000, name="llama"
)
PAPER_MODELS = {"llama-68m": LLAMA_68M, "llama-1.1b": LLAMA_1_1B, "llama-7b": LLAMA_7B, "llama-13b": LLAMA_13B}


@dataclass(frozen=True)
class Runtime:
    """T(b, F) = c1·F·b + c2 seconds: one pass over b tasks of F FLOPs each (Eq. 17)."""

    c1: float
    c2: float

    def __call__(self, batch: float, flops: float | np.ndarray) -> float | np.ndarray:
        return self.c1 * flops * batch + self.c2


PAPER_DRAFT_RUNTIME = Runtime(c1=4.11e-13, c2=0.56e-3)  # Table II, RTX 3080 (SBS)
PAPER_VERIFY_RUNTIME = Runtime(c1=2.08e-14, c2=1.28e-2)  # Table II, RTX 4500 (MBS)


def fit_runtime(points: Iterable[tuple[float, float, float]]) -> Runtime:
    """Least-squares fit of T(b, F) = c1·F·b + c2 to measured (b, F, seconds) points (Eq. 17).

    The model is linear in x = F·b, so this is ordinary least squares on (x, t). Needs two distinct x values.
    """
    pts = [(float(b) * float(f), float(t)) for b, f, t in points]
    if len({x for x, _ in pts}) < 2:
        raise ValueError("fitting T(b, F) needs points with at least two distinct F·b")
    x = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    mx, my = x.mean(), y.mean()
    c1 = float(((x - mx) * (y - my)).sum() / ((x - mx) ** 2).sum())
    return Runtime(c1=c1, c2=float(my - c1 * mx))


# --- FLOPs of one pass per task (Eqs. 11-14, with real architectures) ----------------------------------------------


@dataclass(frozen=True)
class PassFlops:
    """FLOPs of `tokens` positions that together attend to `attended` (query, key) pairs: tokens·W + attended·P."""

    per_token: float  # W: projections, FFN, norms of one position through every decoder layer
    per_pair: float  # P: QKᵀ and A·V of one (query, key) pair through every layer

    @classmethod
    def of(cls, arch: ModelArch) -> PassFlops:
        weights = sum(flops_breakdown(arch, 1, 0, 0).values())
        pair = sum(flops_breakdown(arch, 0, 1, 0).values())
        return cls(weights, pair)

    def __call__(self, tokens: float | np.ndarray, attended: float | np.ndarray) -> float | np.ndarray:
        return self.per_token * tokens + self.per_pair * attended


def _prefill_pairs(n: float | np.ndarray) -> float | np.ndarray:
    return n * (n + 1) / 2


def num_steps(output_len: float, alpha: float, spec_len: int) -> int:
    """n = ceil(O / L(l, α)) decoding steps (Eq. 8)."""
    return max(1, math.ceil(output_len / expected_tokens_per_verification(alpha, spec_len) - 1e-9))


@dataclass(frozen=True)
class Pair:
    """A draft/verify deployment: the two models and the two nodes' runtime coefficients."""

    draft: ModelArch
    verify: ModelArch
    draft_runtime: Runtime = PAPER_DRAFT_RUNTIME
    verify_runtime: Runtime = PAPER_VERIFY_RUNTIME

    @property
    def draft_flops(self) -> PassFlops:
        return PassFlops.of(self.draft)

    @property
    def verify_flops(self) -> PassFlops:
        return PassFlops.of(self.verify)


def step_times(
    pair: Pair, batch: int, input_len: int, spec_len: int, alpha: float, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """(T^d_n, T^v_n) for n = 1..steps of one batch of `batch` tasks padded to `input_len` (Eqs. 13-14, 18-19)."""
    n = np.arange(1, steps + 1, dtype=float)
    big_l = expected_tokens_per_verification(alpha, spec_len)
    fd, fv = pair.draft_flops, pair.verify_flops
    rd, rv = pair.draft_runtime, pair.verify_runtime
    lv = float(spec_len)
    # Draft: l sequential passes. Pass i attends to kv_i + 1 positions, kv_i = I + (n−1)L − 1 + i − 1 (Eq. 13).
    base = input_len + (n - 1) * big_l - 1
    pairs = lv * (base + 1) + lv * (lv - 1) / 2
    draft_flops = fd(lv, pairs)
    # Step 1, pass 1 is the prompt's prefill instead of a 1-token pass over an empty-ish cache.
    first_decode = fd(1.0, input_len - 1 + 1)
    draft_flops[0] = draft_flops[0] - first_decode + fd(float(input_len), _prefill_pairs(float(input_len)))
    t_draft = rd.c1 * batch * draft_flops + lv * rd.c2
    # Verify: step 1 runs the prompt plus l drafts; later steps run the bonus token plus l drafts (Eq. 14).
    kv = input_len + (n - 1) * big_l - 1
    verify_flops = fv(lv + 1, (lv + 1) * kv + (lv + 1) * (lv + 2) / 2)
    verify_flops[0] = fv(float(input_len + spec_len), _prefill_pairs(float(input_len + spec_len)))
    t_verify = rv.c1 * batch * verify_flops + rv.c2
    return t_draft, t_verify


def ad_step_times(runtime: Runtime, arch: ModelArch, batch: int, input_len: int, steps: int) -> np.ndarray:
    """Autoregressive decoding on the verify model alone: prefill, then one token per step."""
    f = PassFlops.of(arch)
    n = np.arange(1, steps + 1, dtype=float)
    flops = f(1.0, input_len + n - 1)
    flops[0] = f(float(input_len), _prefill_pairs(float(input_len)))
    return runtime.c1 * batch * flops + runtime.c2


# --- the two-stage pipeline (Eqs. 20-22) -------------------------------------------------------------------------


def pipeline_latency(draft: Sequence[np.ndarray], verify: Sequence[np.ndarray], *, pipelined: bool = True) -> float:
    """T_inf = Σ_n C_{n,M_n} for batches in order; batch m is active for len(draft[m]) steps (Eqs. 20-22).

    pipelined=False: the draft and verify phases of each batch run back to back ("SD without pipeline").
    """
    if len(draft) != len(verify):
        raise ValueError("one draft and one verify time series per batch")
    if not draft:
        return 0.0
    n_max = max(len(d) for d in draft)
    cd = np.zeros(n_max)  # C^d_{n,m}: the draft node's clock
    c = np.zeros(n_max)  # C_{n,m}: the verify node's clock
    for td, tv in zip(draft, verify, strict=True):
        k = len(td)
        if len(tv) != k:
            raise ValueError("a batch's draft and verify series must have the same number of steps")
        if pipelined:
            cd[:k] += td
            c[:k] = np.maximum(cd[:k], c[:k]) + tv
        else:
            c[:k] += td + tv
    return float(c.sum())


# --- memory (Eqs. 9-10, with grouped-query KV) ----------------------------------------------------------------


def draft_memory_bytes(arch: ModelArch, batch: int, input_len: int, output_len: int, bytes_per: int = 2) -> float:
    """Γ^d_m = weights + KV of `batch` tasks of (I_m + O_m) positions, FP16 (Eqs. 9-10; KV heads as the model has)."""
    d, i = arch.hidden, arch.intermediate
    per_layer = (
        2 * d * arch.n_heads * arch.hd + 2 * d * arch.n_kv_heads * arch.hd + (3 if arch.gated_ffn else 2) * d * i
    )
    weights = arch.n_layers * per_layer * bytes_per
    kv = batch * arch.n_layers * 2 * arch.n_kv_heads * arch.hd * bytes_per * (input_len + output_len)
    return weights + kv


# --- batching: Alg. 1, corrected ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    input_len: int
    output_len: int


@dataclass
class BatchPlan:
    """Batches as lists of task indices (in processing order), the speculation length, and the planned T_inf."""

    batches: list[list[int]]
    spec_len: int
    planned: float
    per_l: dict[int, float] = field(default_factory=dict)


Variant = Literal["corrected", "printed"]


StepTimes = Callable[[int, int], tuple[np.ndarray, np.ndarray]]  # (batch, input_len) -> (T^d_n, T^v_n) per step


@dataclass
class _Ctx:
    pair: Pair | None
    lengths: list[int]  # sorted input lengths
    spec_len: int
    alpha: float
    steps: int
    step_fn: StepTimes | None = None
    cache: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def times(self, batch: int, input_len: int) -> tuple[np.ndarray, np.ndarray]:
        key = (batch, input_len)
        hit = self.cache.get(key)
        if hit is None:
            if self.step_fn is not None:
                hit = self.step_fn(batch, input_len)
            else:
                assert self.pair is not None
                hit = step_times(self.pair, batch, input_len, self.spec_len, self.alpha, self.steps)
            self.cache[key] = hit
        return hit


def plan_batches(
    lengths: Sequence[int],
    pair: Pair | None,
    spec_len: int,
    alpha: float,
    max_output: int,
    *,
    memory: float | None = None,
    variant: Variant = "corrected",
    times: StepTimes | None = None,
) -> BatchPlan:
    """Alg. 1 for a given l: sort by input length, DP over contiguous groups, backtrack. O(K²·N).

    memory: Γ_s in bytes (skip groups whose draft memory exceeds it); None = no limit. Ties go to the later j,
    as Alg. 1's `>=` does. times: the per-step stage times of a batch (batch size, its longest input) in place
    of the FLOPs model's `step_times` (then `pair` may be None and the steps are as many as `times` returns).
    """
    k = len(lengths)
    if k == 0:
        return BatchPlan([], spec_len, 0.0)
    if pair is None and (times is None or memory is not None):
        raise ValueError("plan_batches needs a Pair unless `times` is given and there is no memory limit")
    order = sorted(range(k), key=lambda t: lengths[t])
    srt = [int(lengths[t]) for t in order]
    steps = num_steps(max_output, alpha, spec_len) if times is None else len(times(1, srt[0])[0])
    ctx = _Ctx(pair, srt, spec_len, alpha, steps, times)
    zero = np.zeros(steps)
    y0: list[np.ndarray] = [zero]  # Υ[i, ·, 0]: draft-node completion per step of the first i tasks
    y1: list[np.ndarray] = [zero]  # Υ[i, ·, 1]: verify-node completion per step
    best = [0.0]
    choice = [0] * (k + 1)  # S[i]: first task (1-based) of the last batch ending at task i
    for i in range(1, k + 1):
        top, star, star_td, star_tv = math.inf, 0, zero, zero
        for j in range(1, i + 1):
            b = i - j + 1
            if memory is not None and draft_memory_bytes(pair.draft, b, srt[i - 1], max_output) > memory:  # type: ignore[union-attr]
                continue
            td, tv = ctx.times(b, srt[i - 1])
            if variant == "corrected":
                total = float((np.maximum(y0[j - 1] + td, y1[j - 1]) + tv).sum())
            else:  # printed Eq. 29: T^d added to the verify node's clock
                total = float((np.maximum(y0[j - 1], y1[j - 1] + td) + tv).sum())
            if total <= top:
                top, star, star_td, star_tv = total, j, td, tv
        if star == 0:
            raise ValueError(f"no batch ending at task {i} fits in memory")
        choice[i] = star
        best.append(top)
        d = y0[star - 1] + star_td  # Eq. 31
        y0.append(d)
        y1.append(np.maximum(d, y1[star - 1]) + star_tv)  # Eq. 32
    batches = backtrack(choice)
    return BatchPlan([[order[t] for t in b] for b in batches], spec_len, best[k])


def backtrack(choice: Sequence[int]) -> list[list[int]]:
    """Batches (0-based sorted positions, in order) from S: i = K; while i ≥ 1: batch S[i]..i; i = S[i] − 1."""
    out: list[list[int]] = []
    i = len(choice) - 1
    while i >= 1:
        j = choice[i]
        if not 1 <= j <= i:
            raise ValueError(f"S[{i}] = {j} is not a batch start")
        out.append(list(range(j - 1, i)))
        i = j - 1
    out.reverse()
    return out


def plan_latency(
    batches: Sequence[Sequence[int]],
    tasks: Sequence[Task],
    pair: Pair,
    spec_len: int,
    alpha: float,
    *,
    pipelined: bool = True,
    max_output: int | None = None,
) -> float:
    """T_inf of a plan: each batch padded to its longest input, active for ceil(O_m / L) steps (O_m its longest
    output, or max_output for every batch when given, the DP's planning model)."""
    draft, verify = [], []
    for b in batches:
        inp = max(tasks[t].input_len for t in b)
        out = max_output if max_output is not None else max(tasks[t].output_len for t in b)
        td, tv = step_times(pair, len(b), inp, spec_len, alpha, num_steps(out, alpha, spec_len))
        draft.append(td)
        verify.append(tv)
    return pipeline_latency(draft, verify, pipelined=pipelined)


def contiguous_partitions(k: int) -> Iterable[list[list[int]]]:
    """Every split of 0..k−1 into contiguous groups (2^(k−1) of them)."""
    for cuts in itertools.product((False, True), repeat=max(0, k - 1)):
        groups, cur = [], [0]
        for pos, cut in enumerate(cuts, start=1):
            if cut:
                groups.append(cur)
                cur = [pos]
            else:
                cur.append(pos)
        groups.append(cur)
        yield groups


def brute_force_contiguous(
    lengths: Sequence[int], pair: Pair, spec_len: int, alpha: float, max_output: int
) -> tuple[float, list[list[int]]]:
    """The best plan over contiguous groups of the length-sorted tasks under the planning model (K ≤ ~14)."""
    order = sorted(range(len(lengths)), key=lambda t: lengths[t])
    tasks = [Task(int(lengths[t]), max_output) for t in order]
    best, arg = math.inf, []
    for groups in contiguous_partitions(len(lengths)):
        val = plan_latency(groups, tasks, pair, spec_len, alpha, max_output=max_output)
        if val < best:
            best, arg = val, groups
    return best, [[order[t] for t in g] for g in arg]


# --- speculation length (Eq. 33) and fixed-size baselines -------------------------------------------------------


def best_spec_len(
    lengths: Sequence[int],
    pair: Pair,
    alpha: float,
    max_output: int,
    *,
    max_spec: int = 10,
    memory: float | None = None,
    variant: Variant = "corrected",
    planner: Callable[[int], list[list[int]]] | None = None,
) -> BatchPlan:
    """Enumerate l = 1..l_max, plan each with Alg. 1 (or `planner(l)`), keep the l with the least planned T_inf."""
    best: BatchPlan | None = None
    per_l: dict[int, float] = {}
    tasks = [Task(int(x), max_output) for x in lengths]
    for spec in range(1, max_spec + 1):
        if planner is None:
            plan = plan_batches(lengths, pair, spec, alpha, max_output, memory=memory, variant=variant)
            batches = plan.batches
        else:
            batches = planner(spec)
        planned = plan_latency(batches, tasks, pair, spec, alpha, max_output=max_output)
        per_l[spec] = planned
        if best is None or planned < best.planned:
            best = BatchPlan(batches, spec, planned)
    assert best is not None
    best.per_l = per_l
    return best


def fixed_size_batches(order: Sequence[int], size: int) -> list[list[int]]:
    """Consecutive batches of `size` tasks in the given order (the static / max / heuristic baselines)."""
    size = max(1, int(size))
    return [list(order[i : i + size]) for i in range(0, len(order), size)]


def max_batch_size(tasks: Sequence[Task], arch: ModelArch, memory: float, max_output: int) -> int:
    """The largest b whose worst-case batch (longest input, O_max) fits the draft node's memory (max batching)."""
    longest = max(t.input_len for t in tasks)
    b = 1
    while b < len(tasks) and draft_memory_bytes(arch, b + 1, longest, max_output) <= memory:
        b += 1
    return b


def heuristic_batch_size(latency_of: Callable[[int], float], k: int, start: int = 2) -> int:
    """Grow the batch size from `start` while the latency improves; stop at the first size that is worse."""
    size, best = start, latency_of(start)
    while size < k:
        nxt = latency_of(size + 1)
        if nxt >= best:
            break
        size, best = size + 1, nxt
    return size


# --- uplink (Eqs. 15, 27) ---------------------------------------------------------------------------------------


def upload_latency(
    lengths: Sequence[int],
    gains: Sequence[float],
    *,
    bits_per_token: float,
    bandwidth: float,
    power: float,
    noise: float,
) -> float:
    """t*_com = Σ_k λ·I_k / (B_w·log2(1 + p·g_k/σ²)): every upload finishes together under Eq. 27's allocation.

    (The paper prints the log's argument as 1 + p_k/g_k·σ²; Eqs. 26-27 need 1 + p_k·g_k/σ².)
    """
    return float(
        sum(
            bits_per_token * i / (bandwidth * math.log2(1 + power * g / noise))
            for i, g in zip(lengths, gains, strict=True)
        )
    )


def bandwidth_shares(lengths: Sequence[int], gains: Sequence[float], *, power: float, noise: float) -> list[float]:
    """w*_k ∝ I_k / log2(1 + p·g_k/σ²) (Eq. 27)."""
    raw = [i / math.log2(1 + power * g / noise) for i, g in zip(lengths, gains, strict=True)]
    total = sum(raw)
    return [r / total for r in raw]
