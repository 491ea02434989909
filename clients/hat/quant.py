"""Weight-only int8 for the device half's drafting-only weights: the draft head's rows and the adapter's projections.

Drafts only propose tokens; verification (the full-vocabulary head in fp32, clients/hat/half.py `head_rows` / `head`)
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

What stays fp32, and why: the input layers (their shallow states go to the worker: they are the LLM's own
computation, and every verified token depends on them) and the verification head (it decides the output).
"""

from __future__ import annotations

import torch
from torch import nn

ACTIVATIONS = torch.bfloat16  # the kernel's fast path on CPUs (see the module docstring)


class Int8Rows:
    """weight [out, in] as int8 with a scale per output row: x [..., in] -> float32 [..., out]."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        # The scale is rounded to the activations' dtype first and the weight quantized against that rounded scale,
        # so the only error is the int8 rounding of each weight (the scale's rounding would bias a whole row).
        scale = (w.abs().amax(dim=1).clamp(min=1e-12) / 127).to(ACTIVATIONS)
        self.scale = scale
        self.qweight = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()

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


def int8_available() -> bool:
    """Whether this torch build runs the weight-only int8 kernel on the CPU (it has since torch 2.3)."""
    try:
        x = torch.zeros(1, 32, dtype=ACTIVATIONS)
        torch._weight_int8pack_mm(x, torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, dtype=ACTIVATIONS))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True
