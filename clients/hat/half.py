"""The device's parts of a HAT split, as one object: the input submodel w^m (embedding + layers 0..m-1), the adapter
Lambda and the output submodel (final norm + LM head), with the two heads made of them.

- The draft head H o Lambda o w^m's last step, `draft_logits`: over a reduced draft vocabulary when one is loaded
  (only its rows of the LM head are multiplied; the other logits are -inf), else the full head; after
  `quantize_drafting`, its rows and the adapter's projections as weight-only int8 (clients/hat/quant.py: drafts only
  propose, so their precision moves the accept length, never the output).
- The verification head, `head_rows`: the output submodel over rows through ragged.rows_linear, batch-invariant (the
  drafting station computes several streams' rows in one call and each row is what it would be alone), and `head`,
  the output submodel's own forward (one stream's rows at a time: the solo path and the prefill's last position).
  For a pick that reads only the argmax (greedy on raw logits, no logprobs), `argmax_rows`: after `quantize_head`,
  int8 scores with the rows that can still win recomputed in fp32 (clients/hat/quant.py ArgmaxHead: the fp32
  argmax exactly, at about a quarter of the head's bytes), else `head_rows`.

The backend drafts and verifies with it, the drafting station batches its streams' work over it, and `tandem
profile` and the benchmarks time its parts. It keeps no per-generation state (a DraftState holds the caches) and
runs on whatever thread calls it: in serving, the backend's model thread (clients/hat/model_thread.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from torch import nn

from clients.hat.adapter import Adapter
from clients.hat.quant import ArgmaxHead, Int8Rows, int8_available, quantize_projections, row_scores
from clients.hat.ragged import rows_linear
from clients.hat.split import InputSubmodel, OutputSubmodel, split_model

REFINED = 8  # the int8 draft head's best rows per position recomputed in fp32 (DeviceHalf._refined)


class DeviceHalf:
    """Input submodel + adapter + output submodel of a model split after layer m (see the module docstring)."""

    def __init__(
        self,
        input_model: InputSubmodel,
        adapter: Adapter,
        output: OutputSubmodel,
        *,
        hidden_size: int,
        num_layers: int,
        vocab_size: int,
    ) -> None:
        self.input = input_model
        self.adapter = adapter
        self.output = output
        self.hidden_size, self.num_layers, self.vocab_size = hidden_size, num_layers, vocab_size
        self.draft_ids: torch.Tensor | None = None  # the reduced draft vocabulary (sorted token ids), if any
        self.draft_weight: torch.Tensor | None = None  # the LM head's rows for them
        self.draft_int8: Int8Rows | None = None  # the draft head's rows as int8 (quantize_drafting)
        self.argmax_head: ArgmaxHead | None = None  # the verification head for argmax-only picks (quantize_head)

    @classmethod
    def load(
        cls, model: nn.Module, m: int, adapter_path: str | os.PathLike[str] | None = None, *, trim: bool = False
    ) -> DeviceHalf:
        """The device half of `model` split after layer m, with the adapter from `adapter_path` (None: untrained,
        initialised from layer m's attention). `trim`: drop the middle layers from `model` (most of its weights; the
        device never runs them) — only for a model this half owns."""
        split = split_model(model, m)
        adapter = Adapter.load(model, adapter_path) if adapter_path else Adapter(model, m)
        if adapter.m != m:
            raise ValueError(f"adapter {adapter_path} was trained for m={adapter.m}, not m={m}")
        adapter.eval()
        if trim:  # after the adapter copied layer m's attention
            model.model.layers = nn.ModuleList(list(model.model.layers)[:m])
        return cls(
            split.input,
            adapter,
            split.output,
            hidden_size=split.hidden_size,
            num_layers=split.num_layers,
            vocab_size=split.vocab_size,
        )

    def load_draft_vocab(self, path: str | os.PathLike[str], eos_ids: Collection[int]) -> None:
        """Draft among the token ids of `path` (JSON {"token_ids": [...]}) and the end tokens only."""
        ids = json.loads(Path(path).read_text())["token_ids"]
        if not ids or any(not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"draft vocabulary {path}: token_ids must be token ids below {self.vocab_size}")
        chosen = torch.tensor(sorted(set(ids) | set(eos_ids)), dtype=torch.long)
        self.draft_ids = chosen
        self.draft_weight = self.output.lm_head.weight[chosen].contiguous()
        if self.draft_int8 is not None:
            self.draft_int8 = Int8Rows(self.draft_weight)

    def quantize_drafting(self) -> bool:
        """Run the drafting-only weights as weight-only int8 (clients/hat/quant.py): the draft head's rows (the
        reduced vocabulary's, else the whole head's: 136 MB more for Qwen2.5-0.5B's) and the adapter's projections.
        The input layers and the verification head stay fp32: they make the output. False (all fp32 kept) where this
        torch has no int8 kernel on the CPU."""
        if not int8_available():
            return False
        self.draft_int8 = Int8Rows(self.draft_weight if self.draft_weight is not None else self.output.lm_head.weight)
        quantize_projections(self.adapter.block)
        return True

    def quantize_head(self) -> bool:
        """Serve argmax-only picks (`argmax_rows`) from an int8 head exact for the argmax (clients/hat/quant.py
        ArgmaxHead): 136 MB more for Qwen2.5-0.5B's head. False (fp32 kept) where this torch has no CPU int8 kernel,
        or where the kernel's error on this CPU is not within half the bound the exactness rests on (checked here on
        normed random states and embedding rows)."""
        if not int8_available():
            return False
        head = self.output.lm_head
        # Built once per weight (~1 s for Qwen2.5-0.5B's): device halves over one model (the tests' and benchmarks'
        # backends) share it while the weight is unchanged; it lives and dies with the head module.
        cached = getattr(head, "_tandem_argmax_head", None)
        if cached is None or cached[0] != head.weight._version:
            cached = head._tandem_argmax_head = (head.weight._version, self._checked_argmax_head())
        self.argmax_head = cached[1]
        return self.argmax_head is not None

    def _checked_argmax_head(self) -> ArgmaxHead | None:
        """An ArgmaxHead of the LM head, if this CPU's int8 kernel is within half its bound on normed random states
        and embedding rows."""
        head = self.output.lm_head
        built = ArgmaxHead(head.weight, head.bias)
        generator = torch.Generator().manual_seed(0)
        probes = torch.cat(
            [
                torch.randn(2, self.hidden_size, generator=generator),
                head.weight[torch.randint(self.vocab_size, (2,), generator=generator)].float(),
            ]
        )
        with torch.inference_mode():
            return built if built.sound(self.output.norm(probes.to(head.weight.dtype))) else None

    def draft_logits(self, feats: torch.Tensor, position: int | list[int]) -> torch.Tensor:
        """Draft head: adapter features [rows, hidden] of tokens fed at `position` (one for all rows, or one per row)
        -> logits [rows, vocab] for the next position.

        With a reduced draft vocabulary only its rows of the head are computed; the other logits are -inf. Rows go
        through the int8 head (quantize_drafting) or ragged.rows_linear: either way a row's logits do not depend on
        the other rows (the drafting station batches streams' rows). `position` does not change the logits here; a
        subclass may use it (the tests' oracle draft heads)."""
        head = self.output.lm_head
        if self.draft_int8 is None and self.draft_ids is None:
            return self.head_rows(feats)
        normed = self.output.norm(feats.to(head.weight.dtype))
        if self.draft_int8 is not None:
            scores = self._refined(self.draft_int8(normed), normed)
        else:
            assert self.draft_weight is not None
            scores = rows_linear(normed, self.draft_weight).float()
        if head.bias is not None:
            scores = scores + (head.bias if self.draft_ids is None else head.bias[self.draft_ids])
        if self.draft_ids is None:
            return scores
        logits = torch.full((feats.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.draft_ids] = scores
        return logits

    def _refined(self, scores: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The int8 head's scores with its REFINED best rows recomputed in fp32 from the stored weights: the int8
        kernel returns bfloat16 (steps of 0.125 at a logit of 20, so near the top many logits tie exactly and the
        draft would pick by token id), while the draft's pick and its confidence (Eq. 5) come from the top few. A row's
        result still does not depend on the other rows (an elementwise product and a sum per row)."""
        weight = self.draft_weight if self.draft_weight is not None else self.output.lm_head.weight
        top = scores.topk(min(REFINED, scores.shape[-1]), dim=-1).indices
        return scores.scatter(-1, top, row_scores(weight, normed, top))

    def head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output submodel (final norm + LM head) over rows, batch-invariant (ragged.rows_linear): float logits."""
        head = self.output.lm_head
        logits = rows_linear(self.output.norm(hidden.to(head.weight.dtype)), head.weight)
        if head.bias is not None:
            logits = logits + head.bias
        return logits.float()

    def argmax_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over rows for a pick that reads only their argmax: that argmax is the fp32 head's exactly (the
        other values are not probabilities' logits: never sample from them). Batch-invariant, like `head_rows`."""
        if self.argmax_head is None:
            return self.head_rows(hidden)
        return self.argmax_head(self.output.norm(hidden.to(self.output.lm_head.weight.dtype)))

    def verification_head(
        self, argmax_only: bool, *, batch_invariant: bool = False
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """The head a verification reads its rows' logits from: `argmax_rows` for a pick that reads only their argmax
        (exact for it), else the fp32 logits — `head_rows` where several streams' rows share a call (batch-invariant:
        the drafting station), else `head` (one stream's rows)."""
        if argmax_only:
            return self.argmax_rows
        return self.head_rows if batch_invariant else self.head

    def head(self, deep: torch.Tensor) -> torch.Tensor:
        """The output submodel's own forward over deep states [rows, hidden]: float logits. Equal to `head_rows` up
        to float reassociation (a blocked GEMM over the rows)."""
        return self.output(deep).float()
