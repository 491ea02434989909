"""Teacher features: what the adapter reads and what it must imitate, computed once per sequence and cached.

They come from the fp32 HF model split after layer m: the input submodel's output (the adapter's input) and the
middle submodel's output f^L (its target), plus, for held-out sequences, the LLM's argmax. Each sequence is cached
in its own safetensors file (~7 KB per token, never pickle) keyed by its text and the split, so a resumed run
does not recompute them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from app.tools import import_extra
from app.tools.training.corpus import Example, short_sha


@dataclass
class Features:
    """One sequence's frozen teacher tensors (fp32): the adapter's input and the LLM's deep states."""

    index: int
    ids: torch.Tensor  # [T] token ids
    prompt_len: int
    shallow: torch.Tensor  # [T, hidden] input submodel output
    deep: torch.Tensor  # [T, hidden] middle submodel output f^L (pre-norm)
    teacher_top1: torch.Tensor | None = None  # [T] the LLM's argmax (full vocabulary), held-out sequences only


def _features_key(ex: Example, model_name: str, m: int, max_len: int) -> str:
    return short_sha(f"{ex.key}\x00{model_name}\x00{m}\x00{max_len}\x00{','.join(map(str, ex.ids))}")


@torch.no_grad()
def compute_features(split: Any, ex: Example, max_len: int, with_top1: bool) -> Features:
    ids = torch.tensor(ex.ids[:max_len], dtype=torch.long)
    shallow = split.input(ids)[0]
    deep = split.middle(shallow)
    top1 = split.output(deep).argmax(-1) if with_top1 else None
    return Features(ex.index, ids, len(ex.prompt_ids), shallow.clone(), deep.clone(), top1)


def load_features(
    split: Any,
    examples: Sequence[Example],
    cache_dir: Path,
    model_name: str,
    max_len: int = 1024,
    with_top1: bool = False,
    progress: bool = True,
    desc: str = "features",
) -> list[Features]:
    """Features of `examples`, read from `cache_dir` (one safetensors file per sequence) or computed and cached."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tqdm = import_extra("tqdm").tqdm
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for ex in tqdm(examples, desc=desc, unit="seq", disable=not progress, dynamic_ncols=True):
        key = _features_key(ex, model_name, split.m, max_len)
        path = cache_dir / f"{ex.index:05d}.safetensors"
        if path.exists():
            try:
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                if meta.get("key") == key and (not with_top1 or meta.get("top1") == "1"):
                    t = load_file(str(path))
                    out.append(
                        Features(ex.index, t["ids"], int(meta["prompt_len"]), t["shallow"], t["deep"], t.get("top1"))
                    )
                    continue
            except Exception:  # a torn file: compute it again
                pass
        feats = compute_features(split, ex, max_len, with_top1)
        tensors = {"ids": feats.ids, "shallow": feats.shallow, "deep": feats.deep}
        if feats.teacher_top1 is not None:
            tensors["top1"] = feats.teacher_top1
        meta = {"key": key, "prompt_len": str(feats.prompt_len), "top1": "1" if with_top1 else "0"}
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
        out.append(feats)
    return out
