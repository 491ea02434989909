"""How one HAT request's tokens are picked: one value, handed to drafting, verification and the drafting station.

The same seven facts decide every pick of a generation — the draft model's (Eq. 5's drafts), verification's (the
LLM's accepted prefix and its next token) and, through them, the station's batched ones: temperature, top-p and
top-k, the seeded generator, the penalties / logit_bias adjuster, the grammar's token mask and the logprobs asked for.
The generator, adjuster and mask are the request's own stateful objects (shared, not copied); the value only
groups them and says which of the backend's shortcuts they allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from clients.base import GenerationRequest
    from clients.grammar import TokenMask
    from clients.sampling import LogitAdjuster


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # <= 0: greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None  # seeded per request (clients.sampling.seeded_generator); None: greedy
    adjust: LogitAdjuster | None = None  # penalties / logit_bias, applied before every pick
    mask: TokenMask | None = None  # the request's grammar, applied after the adjuster
    logprobs: int | None = None  # alternatives per token when the request asked for logprobs
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0  # 0: no min-p cut

    @classmethod
    def of(
        cls,
        request: GenerationRequest,
        generator: torch.Generator | None,
        adjust: LogitAdjuster | None = None,
        mask: TokenMask | None = None,
    ) -> Sampling:
        return cls(
            request.temperature,
            request.top_p,
            generator,
            adjust,
            mask,
            request.logprobs,
            request.top_k,
            request.min_p,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def raw_argmax(self) -> bool:
        """Greedy on the head's own logits (no adjuster, no grammar): verification needs a position's logits only
        once every draft before it was accepted, so the head can run on the first position alone first."""
        return self.greedy and self.adjust is None and self.mask is None

    @property
    def argmax_only(self) -> bool:
        """Every pick reads only the argmax of the head's raw logits (greedy, no adjuster or grammar, no logprobs):
        a head exact for the argmax alone serves it (DeviceHalf.argmax_rows)."""
        return self.raw_argmax and self.logprobs is None

    @property
    def allows_tree(self) -> bool:
        """A token tree may replace the chain: its walk is exact greedy verification on raw logits, and it computes
        the head on the accepted path only (no logprobs for the positions it skips)."""
        return self.argmax_only
