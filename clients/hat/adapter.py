"""The HAT adapter: a one-block stand-in for the cloud's middle layers, trained by distillation.

Draft model on the device: w_S = H o Adapter o input_submodel. The adapter has the structure of one decoder
layer's self-attention block (RMSNorm -> q/k/v/o attention with rotary and grouped KV heads -> residual): attention
is far cheaper than the MLP and still mixes context. It is initialised from layer m's own attention (the probe in
/work/shared/notes/hat-on-cpu.md found that init best: 44% held-out top-1 vs 1% for no adapter) and trained so
its output features match the LLM's deep features at the same positions (HAT Eq. 4):

    Loss = SmoothL1(f_L, f_S) + w_ce * CE(softmax(H(f_L)), H(f_S)),   w_ce = 0.1

Features are compared after the final norm (what the LM head actually reads; raw deep states of Qwen carry huge
outlier dimensions that would dominate a SmoothL1 on unnormalised values). The CE is a soft cross-entropy against
the LLM's own distribution, optionally on a slice of the vocabulary for speed.

Weights are saved with safetensors (never pickle).
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from clients.hat.split import LayerStack, SplitKVCache, SplitModel

SHIPPED_DIR = Path(__file__).resolve().parent / "adapters"


def shipped_adapter_path(model: str, m: int) -> Path:
    """Where the trained adapter for a bundled `model` split at `m` ships (it may not exist)."""
    return SHIPPED_DIR / f"{model}-m{m}.safetensors"


def draft_files(model: str, m: int, adapter: str = "", draft_vocab: str = "") -> tuple[Path | None, Path | None]:
    """(adapter, reduced draft vocabulary) for a HAT device half: the configured ones, else the shipped ones.

    draft_vocab "full" = none. The shipped draft vocabulary goes with the shipped adapter only (it was cut from
    that adapter's training corpus)."""
    shipped = shipped_adapter_path(model, m)
    adapter_path = Path(adapter) if adapter else (shipped if shipped.is_file() else None)
    if draft_vocab == "full":
        return adapter_path, None
    if draft_vocab:
        return adapter_path, Path(draft_vocab)
    vocab = shipped.with_suffix(".draft-vocab.json")
    return adapter_path, vocab if adapter_path == shipped and vocab.is_file() else None


class AdapterBlock(nn.Module):
    """RMSNorm -> self-attention -> residual, called like a HF decoder layer (so LayerStack can drive it)."""

    def __init__(self, input_layernorm: nn.Module, self_attn: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = input_layernorm
        self.self_attn = self_attn

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        out, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        return hidden_states + out


class Adapter(nn.Module):
    """The adapter Lambda for a model split after layer m. Owns copies of its weights (training never touches the LLM).

    `init_from`: index of the decoder layer whose attention block is copied (default m); `random_init` re-draws
    the projections instead (a baseline).
    """

    def __init__(self, model: nn.Module, m: int, init_from: int | None = None, random_init: bool = False) -> None:
        super().__init__()
        n = model.config.num_hidden_layers
        src_idx = m if init_from is None else init_from
        if not 0 <= src_idx < n:
            raise ValueError(f"init_from must be a layer index in [0, {n}), got {src_idx}")
        src = model.model.layers[src_idx]
        block = AdapterBlock(copy.deepcopy(src.input_layernorm), copy.deepcopy(src.self_attn))
        block.self_attn.layer_idx = m  # indexes its own one-layer cache
        for p in block.parameters():
            p.requires_grad_(True)
        if random_init:
            std = getattr(model.config, "initializer_range", 0.02)
            for mod in block.modules():
                if isinstance(mod, nn.Linear):
                    nn.init.normal_(mod.weight, std=std)
                    if mod.bias is not None:
                        nn.init.zeros_(mod.bias)
        self.m = m
        self.init_from = src_idx
        self.block = block
        self.stack = LayerStack(model.config, model.model.rotary_emb, [block], range(m, m + 1))

    def new_cache(self) -> SplitKVCache:
        return self.stack.new_cache()

    def forward(
        self,
        shallow: torch.Tensor,
        cache: SplitKVCache | None = None,
        positions: torch.Tensor | int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Shallow states (input submodel output) -> draft features in the space of the middle submodel's output."""
        return self.stack.run(shallow, cache, positions, attention_mask)

    # --- persistence (safetensors, no pickle) --------------------------------------------------------

    def save(self, path: str | os.PathLike[str], extra: dict[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        meta = {"m": str(self.m), "init_from": str(self.init_from), **(extra or {})}
        tensors = {k: v.detach().contiguous() for k, v in self.block.state_dict().items()}
        save_file(tensors, os.fspath(path), metadata=meta)

    @classmethod
    def load(cls, model: nn.Module, path: str | os.PathLike[str]) -> Adapter:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(os.fspath(path), "pt") as f:
            meta = f.metadata() or {}
        if "m" not in meta:
            raise ValueError(f"{path}: not a Tandem adapter file (no 'm' in metadata)")
        adapter = cls(model, int(meta["m"]), init_from=int(meta.get("init_from", meta["m"])))
        adapter.block.load_state_dict(load_file(os.fspath(path)))
        return adapter


def distillation_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    split: SplitModel,
    w_ce: float = 0.1,
    vocab_subset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """HAT Eq. 4 on features [.., hidden]: SmoothL1 on normed features + w_ce * soft CE through the LM head."""
    norm, head = split.output.norm, split.output.lm_head
    weight = head.weight if vocab_subset is None else head.weight[vocab_subset]
    bias = getattr(head, "bias", None)
    if bias is not None and vocab_subset is not None:
        bias = bias[vocab_subset]
    with torch.no_grad():
        ft = norm(teacher)
        p_teacher = F.softmax(F.linear(ft, weight, bias).float(), dim=-1)
    fs = norm(student)
    sl = F.smooth_l1_loss(fs, ft)
    log_p_student = F.log_softmax(F.linear(fs, weight, bias).float(), dim=-1)
    ce = -(p_teacher * log_p_student).sum(-1).mean()
    loss = sl + w_ce * ce
    return loss, {"loss": float(loss.detach()), "smooth_l1": float(sl.detach()), "ce": float(ce.detach())}


@dataclass
class TrainConfig:
    steps: int = 200
    lr: float = 1e-3
    lr_min: float = 1e-4
    weight_decay: float = 0.0
    w_ce: float = 0.1
    vocab_subset_size: int | None = None  # CE on the most frequent teacher tokens + a random slice, for speed
    max_len: int = 1024
    seed: int = 0


@dataclass
class TeacherExample:
    """One training sequence's frozen inputs and targets (computed once: the LLM is the expensive part)."""

    shallow: torch.Tensor  # [tokens, hidden] input-submodel output
    deep: torch.Tensor  # [tokens, hidden] middle-submodel output (pre-norm)


@torch.no_grad()  # not inference_mode: these tensors feed autograd later
def teacher_example(split: SplitModel, ids: Sequence[int]) -> TeacherExample:
    shallow = split.input(torch.as_tensor(list(ids), dtype=torch.long))[0]
    deep = split.middle(shallow)
    return TeacherExample(shallow.clone(), deep.clone())


class AdapterTrainer:
    """AdamW with a cosine schedule lr -> lr_min over `steps`; one step = one batch of teacher examples."""

    def __init__(self, split: SplitModel, adapter: Adapter, config: TrainConfig | None = None) -> None:
        self.split = split
        self.adapter = adapter
        self.config = config or TrainConfig()
        self.step_count = 0
        # Only the adapter learns. Freezing the LLM also keeps autograd from allocating a gradient for the LM head
        # (136M parameters on Qwen 0.5B) on every step. Note: this changes requires_grad on the shared model.
        for module in (split.input, split.middle, split.output):
            for p in module.parameters():
                p.requires_grad_(False)
        self.opt = torch.optim.AdamW(adapter.parameters(), lr=self.config.lr, weight_decay=self.config.weight_decay)
        self._gen = torch.Generator().manual_seed(self.config.seed)

    def lr_at(self, step: int) -> float:
        c = self.config
        t = min(step / max(1, c.steps), 1.0)
        return c.lr_min + 0.5 * (c.lr - c.lr_min) * (1 + math.cos(math.pi * t))

    def _vocab_subset(self, batch: Sequence[TeacherExample]) -> torch.Tensor | None:
        size = self.config.vocab_subset_size
        vocab = self.split.vocab_size
        if size is None or size >= vocab:
            return None
        with torch.no_grad():
            top = torch.cat([self.split.output(ex.deep).argmax(-1) for ex in batch]).unique()
        rand = torch.randperm(vocab, generator=self._gen)[:size]
        return torch.cat([top, rand]).unique()[: max(size, top.numel())]

    def step(self, batch: Sequence[TeacherExample]) -> dict[str, float]:
        """One optimiser step on `batch` (sequences of any lengths, each causal on its own)."""
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.step_count)
        self.adapter.train()
        subset = self._vocab_subset(batch)
        self.opt.zero_grad(set_to_none=True)
        total = sum(ex.shallow.shape[0] for ex in batch)
        stats = {"loss": 0.0, "smooth_l1": 0.0, "ce": 0.0}
        for ex in batch:
            n = min(ex.shallow.shape[0], self.config.max_len)
            feats = self.adapter(ex.shallow[:n])
            loss, parts = distillation_loss(feats, ex.deep[:n], self.split, self.config.w_ce, subset)
            (loss * (n / total)).backward()
            for k in stats:
                stats[k] += parts[k] * n / total
        self.opt.step()
        self.step_count += 1
        stats["lr"] = self.lr_at(self.step_count - 1)
        return stats

    @torch.inference_mode()
    def evaluate(self, examples: Sequence[TeacherExample], from_position: int = 0) -> dict[str, float]:
        """Top-1 agreement of the draft head with the LLM (full vocabulary), from `from_position` on."""
        self.adapter.eval()
        agree = count = 0
        for ex in examples:
            draft = self.split.output(self.adapter(ex.shallow)).argmax(-1)[from_position:]
            target = self.split.output(ex.deep).argmax(-1)[from_position:]
            agree += int((draft == target).sum())
            count += int(target.numel())
        return {"top1_agreement": agree / count if count else 0.0, "tokens": float(count)}

    def config_json(self) -> str:
        return json.dumps(asdict(self.config), sort_keys=True)
