"""Weight-only int8 for the device half: its drafting-only weights (the draft head's rows, the adapter's projections)
and, exact for the argmax, its verification head (ArgmaxHead).

Drafts only propose tokens; verification (the full-vocabulary head, clients/hat/half.py `head_rows` / `head`)
decides every emitted token, so a draft head that is a little less precise changes how many drafts are accepted,
never the output. Both weights here therefore run as int8 with one scale per output row (symmetric, max-abs / 127),
multiplied by torch's weight-only int8 kernel (`torch._weight_int8pack_mm`) with bfloat16 activations and scales.

Why this kernel and these dtypes (measured on this box's AVX-512 Xeon, torch 2.13, one thread, best of 30, on a
loaded machine, side by side in one process): the 9,450-row draft head costs 0.50 ms a row alone and 0.85 ms for 4
rows, against 2.5 / 2.7 ms for the fp32 `rows_linear` it replaces (F.linear: 1.2 / 2.3 ms); the 896×896 adapter
projection 0.036 / 0.075 ms against 0.21 / 0.20 (F.linear 0.10 / 0.20). The same kernel with float32 activations
is slower than fp32 (4.6 ms a row: no vectorised path), with float16 far slower (11 ms), so bfloat16 it is.
Each row's result does not depend on the other rows of the call (the kernel computes every output element as its
own dot product; checked for 1-9 rows in tests/unit/test_hat_quant.py), which the drafting station's batching needs.
The kernel's output is bfloat16 too, coarse near the top of a draft distribution (exact ties), so the draft head
recomputes its few best rows in fp32 (clients/hat/half.py, DeviceHalf._refined).

The verification head decides the output, so it runs int8 only where that provably changes nothing: a greedy pick
on the head's own logits reads only their argmax. ArgmaxHead scores every row with the same int8 kernel, bounds each
score's error (weight rounding, bfloat16 activations, accumulation, the bfloat16 result: see `bound`), and recomputes
in fp32 every row whose upper bound reaches the best lower bound — the argmax is always among them, so it is the fp32
head's argmax exactly (typically 4-6 rows of Qwen2.5's 151,936 are recomputed, at most ~30 on held-out text). Sampling,
logprobs, penalties and grammars read more than the argmax: they keep the fp32 head.

What stays fp32, and why: the input layers (their shallow states go to the worker: they are the LLM's own
computation, and every verified token depends on them) and the verification head wherever more than its argmax is read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = torch.bfloat16  # the kernel's fast path on CPUs (see the module docstring)
QUANTIZE_ROWS = 2048  # rows quantized at a time


def row_scores(weight: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """fp32 scores of some rows of `weight` [out, in] for states x [..., in]: `rows` [..., k] (ids per state) or a
    slice -> [..., k]. An elementwise product and a sum per row, so a row's score depends neither on which other rows
    are asked for nor on the other states."""
    return (weight[rows] * x.unsqueeze(-2)).sum(-1)


class Int8Rows:
    """weight [out, in] as int8 with a scale per output row: x [..., in] -> float32 [..., out]."""

    def __init__(self, weight: torch.Tensor) -> None:
        weight = weight.detach()
        self.scale = torch.empty(weight.shape[0], dtype=ACTIVATIONS)
        self.qweight = torch.empty(weight.shape, dtype=torch.int8)
        self.error_norm = torch.empty(weight.shape[0])  # ||w_r - q_r s_r|| per row (ArgmaxHead's bound)
        self.weight_norm = torch.empty(weight.shape[0])  # ||q_r s_r||
        for lo in range(0, weight.shape[0], QUANTIZE_ROWS):  # a block at a time: its temporaries stay in cache
            w = weight[lo : lo + QUANTIZE_ROWS].float()
            # The scale is rounded to the activations' dtype first and the weight quantized against that rounded
            # scale, so the only error is the int8 rounding of each weight (the scale's rounding would bias a row).
            scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(ACTIVATIONS)
            q = torch.round(w / scale.float()[:, None]).clamp(-127, 127)
            dequantized = q * scale.float()[:, None]
            block = slice(lo, lo + w.shape[0])
            self.scale[block], self.qweight[block] = scale, q
            self.error_norm[block] = (w - dequantized).norm(dim=1)
            self.weight_norm[block] = dequantized.norm(dim=1)

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    def dequantized(self) -> torch.Tensor:
        """The weight this computes with, in fp32 (tests and error bounds)."""
        return self.qweight.float() * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(ACTIVATIONS)
        out = torch._weight_int8pack_mm(flat, self.qweight, self.scale)
        return out.float().reshape(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """An nn.Linear's drop-in with Int8Rows weights (the adapter's q/k/v/o projections): same input and output dtype
    as the module it replaces. The drafting station's ragged forward calls it as it is (ragged.project_rows)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.rows = Int8Rows(linear.weight)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.rows(x)
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


def quantize_projections(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by an Int8Linear; returns how many were replaced."""
    targets = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()]
    count = 0
    for parent, name, child in targets:
        if isinstance(child, nn.Linear):
            setattr(parent, name, Int8Linear(child))
            count += 1
    return count


class ArgmaxHead:
    """An LM head for greedy picks: x [rows, in] (normed states) -> float32 logits [rows, out] whose argmax is exactly
    that of the fp32 scores `exact` computes, row by row. Rows that cannot be the argmax keep their int8 scores (each
    below its upper bound, below the best row's exact score), so only the argmax is meaningful: never use the result
    for probabilities. A row's result does not depend on the other rows of the call (the int8 kernel is row-invariant,
    and the candidates are chosen and recomputed per row)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.detach()  # the fp32 rows the candidates are recomputed from (the model's own, not a copy)
        self.bias = None if bias is None else bias.detach().float()
        self.rows = Int8Rows(self.weight)
        self.candidates = 0  # rows recomputed in fp32, over all calls (benchmarks)

    def exact(self, x: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
        """fp32 scores of `rows` (ids, or a slice) for one state x [in]: the reference the argmax is exact against."""
        scores = row_scores(self.weight, x, rows)
        return scores if self.bias is None else scores + self.bias[rows]

    def bound(self, x: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
        """|exact - approx| <= bound, per row, for one state x [in] and its int8 scores (before any bias). By
        Cauchy-Schwarz, the int8 weights' error contributes ||x|| ||w - q s|| and the bfloat16 activations'
        ||x - bf16(x)|| ||q s||; fp32 accumulation (the kernel's and the reference's) at most 2 n 2^-24 ||x|| ||w||;
        the kernel's bfloat16 result at most 2^-9 |approx| (2^-7 taken: also an intermediate rounding). Measured on
        Qwen2.5-Coder-0.5B's head over held-out text, the largest error was 0.16 of this bound (`sound` checks a
        margin of 2 at load)."""
        n = x.shape[-1]
        norm = x.norm()
        activation_error = (x - x.to(ACTIVATIONS).float()).norm()
        per_weight = activation_error + norm * (2 * n * 2.0**-24)
        return self.rows.error_norm * norm + self.rows.weight_norm * per_weight + approx.abs() * 2.0**-7 + 1e-6

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        approx = self.rows(x)
        out = approx if self.bias is None else approx + self.bias
        for i in range(x.shape[0]):
            bound = self.bound(x[i], approx[i])
            best_low = (out[i] - bound).max()
            rows = (out[i] + bound >= best_low).nonzero().squeeze(1)
            out[i, rows] = self.exact(x[i], rows)
            self.candidates += int(rows.numel())
        return out

    def sound(self, x: torch.Tensor, margin: float = 2.0) -> bool:
        """Whether this CPU's int8 kernel stays within bound / margin of the fp32 scores on states x [rows, in], every
        row of the head (checked at load: the bound assumes fp32 accumulation inside the kernel)."""
        x = x.float()
        approx = self.rows(x)
        # The fp32 scores by a GEMM, not `exact`'s row sums: they differ by float reassociation, which the bound's
        # accumulation term covers, and the GEMM reads the weights once for every state.
        error = (F.linear(x, self.weight.float()) - approx).abs()  # the bias, exact on both sides, left out
        return all(bool((error[i] * margin <= self.bound(x[i], approx[i])).all()) for i in range(x.shape[0]))


def int8_available() -> bool:
    """Whether this torch build runs the weight-only int8 kernel on the CPU (it has since torch 2.3)."""
    try:
        x = torch.zeros(1, 32, dtype=ACTIVATIONS)
        torch._weight_int8pack_mm(x, torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, dtype=ACTIVATIONS))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True
