"""The HAT adapter: a one-block stand-in for the cloud's middle layers, run by the device half to draft tokens.

Draft model on the device: w_S = H o Adapter o input_submodel. The adapter has the structure of one decoder
layer's self-attention block (RMSNorm -> q/k/v/o attention with rotary and grouped KV heads -> residual): attention
is far cheaper than the MLP and still mixes context. It is initialised from layer m's own attention (a probe found
that init best: 44% held-out top-1 vs 1% for no adapter) and distilled from the LLM by `tandem train-adapter`
(app/tools/training/), which ships its result next to this module.

Weights are saved with safetensors (never pickle).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from clients.hat.split import LayerStack, SplitKVCache

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
