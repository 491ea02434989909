"""U-shaped split of a Hugging Face Llama/Qwen2-family causal LM (HAT).

    input submodel   = embed_tokens + layers[:m]         (device)
    middle submodel  = layers[m:]                        (cloud worker)
    output submodel  = final norm + lm_head              (device)

Why by hand: HAT ships hidden states between the halves, keeps a KV cache on
each side, appends prompt chunks to it as they arrive, and rolls it back when
draft positions are rejected. `model.forward` offers none of that, so each
submodel drives the model's own decoder layers directly, with rotary position
embeddings from `model.model.rotary_emb` and an explicit attention mask.

The submodels share parameters with the original model (no copies). Each
attention-bearing submodel has its own `SplitKVCache`; the output submodel has
no attention and so no cache. Masks are built from the cached keys' absolute
positions: a query at position p sees every key at a position <= p (within the
sliding window for sliding-attention layers). For contiguous positions that is
the ordinary causal mask; it also makes chunked prefill (a chunk attends to
the cached prefix and causally to itself) and decode at arbitrary positions
exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DEFAULT_SPLIT_LAYERS = 2
_SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


class SplitKVCache:
    """Key/value cache for one contiguous range of decoder layers, keyed by the layers' global index.

    Implements the one method HF attention modules call (`update`), plus the absolute positions of the cached
    tokens (needed for masks) and `crop` for KV rollback. Batch rows share positions.

    Each layer's keys and values live in a buffer [batch, kv_heads, capacity, head_dim] whose first `used` positions
    are the cache, and `update` returns views of that prefix. The capacity grows geometrically (GROWTH), never past
    `max_positions` when one is given (the worker's context limit, so its KV reserve holds): appending x positions
    costs O(x) amortised instead of a copy of the whole context per layer per pass, which made a long-context pass
    cost several times its rows. Rolling back (crop, restore) only lowers `used`; the memory stays for the next append.
    """

    is_compileable = False
    GROWTH = 1.5
    MIN_CAPACITY = 64

    def __init__(self, layer_indices: range, max_positions: int | None = None) -> None:
        self.layer_indices = layer_indices
        self.max_positions = max_positions
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._used: dict[int, int] = {}
        self.positions = torch.empty(0, dtype=torch.long)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's keys/values ([batch, kv_heads, new, head_dim]) and return the full cached ones."""
        if layer_idx not in self.layer_indices:
            raise IndexError(f"layer {layer_idx} is not in this cache's range {self.layer_indices}")
        used = self._used.get(layer_idx, 0)
        end = used + key_states.shape[-2]
        keys, values = self._keys.get(layer_idx), self._values.get(layer_idx)
        if keys is None or values is None:
            keys, values = self._alloc(key_states, end), self._alloc(value_states, end)
        else:
            for new, buf in ((key_states, keys), (value_states, values)):
                # copy_ would broadcast a one-row append into every row of a forked cache: refuse it as cat did
                if new.shape[:2] != buf.shape[:2] or new.shape[-1] != buf.shape[-1]:
                    raise ValueError(f"cannot append {tuple(new.shape)} to a cache of {tuple(buf.shape)}")
            if end > keys.shape[-2]:
                keys, values = self._grown(keys, used, end), self._grown(values, used, end)
        _write(keys[:, :, used:end], key_states)
        _write(values[:, :, used:end], value_states)
        # the layer counts as appended only once both writes are done: a failure above leaves it as it was
        self._keys[layer_idx], self._values[layer_idx], self._used[layer_idx] = keys, values, end
        return keys[:, :, :end], values[:, :, :end]

    def _capacity(self, needed: int, current: int = 0) -> int:
        grown = max(needed, int(current * self.GROWTH), self.MIN_CAPACITY)
        return max(needed, min(grown, self.max_positions)) if self.max_positions is not None else grown

    def _alloc(self, like: torch.Tensor, needed: int, current: int = 0) -> torch.Tensor:
        b, h, _, d = like.shape
        return like.new_empty(b, h, self._capacity(needed, current), d)

    def _grown(self, buf: torch.Tensor, used: int, needed: int) -> torch.Tensor:
        out = self._alloc(buf, needed, buf.shape[-2])
        _write(out[:, :, :used], buf[:, :, :used])
        return out

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cached keys and values ([batch, kv_heads, cached, head_dim] views)."""
        used = self._used[layer_idx]
        return self._keys[layer_idx][:, :, :used], self._values[layer_idx][:, :, :used]

    def __len__(self) -> int:
        return int(self.positions.numel())

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return len(self)

    @property
    def next_position(self) -> int:
        """Where the next token goes by default: one past the highest cached position."""
        return int(self.positions.max()) + 1 if len(self) else 0

    def crop(self, n: int) -> None:
        """Keep the first `n` cached positions (KV rollback after rejected drafts)."""
        if n < 0:
            raise ValueError(f"cannot keep {n} positions")
        if n < len(self):
            self.positions = self.positions[:n].clone()
        self._truncate_layers(len(self))

    def keep(self, slots: Sequence[int]) -> None:
        """Keep only the cached entries at `slots` (strictly ascending indices into the cache), in that order: after a
        token-tree round, the committed prefix plus the accepted path's nodes."""
        idx = torch.as_tensor(list(slots), dtype=torch.long)
        n = len(self)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n or bool((idx[1:] <= idx[:-1]).any())):
            raise ValueError(f"slots to keep must be strictly ascending indices below {n}")
        kept = {i: tuple(t.index_select(-2, idx.to(t.device)) for t in self.layer(i)) for i in self._keys}
        self.positions = self.positions[idx].clone()
        for i, (k, v) in kept.items():
            _write(self._keys[i][:, :, : k.shape[-2]], k)
            _write(self._values[i][:, :, : v.shape[-2]], v)
            self._used[i] = k.shape[-2]

    def restore(self, positions: torch.Tensor) -> None:
        """Return to an earlier state given its positions: undoes a partly applied append after a failed forward."""
        self.positions = positions
        self._truncate_layers(len(self))

    def fork(self, rows: int, keep: int) -> SplitKVCache:
        """A copy of the first `keep` positions with `rows` identical batch rows (sharing positions): one row per
        candidate continuation, all fed in one batched step."""
        out = SplitKVCache(self.layer_indices, self.max_positions)
        for i in self._keys:
            for mine, theirs in zip(self.layer(i), (out._keys, out._values), strict=True):
                prefix = mine[:1, :, :keep]
                buf = theirs[i] = out._alloc(prefix.expand(rows, -1, -1, -1), prefix.shape[-2])
                _write(buf[:, :, : prefix.shape[-2]], prefix)
                out._used[i] = prefix.shape[-2]
        out.positions = self.positions[:keep].clone()
        return out

    def row(self, row: int) -> SplitKVCache:
        """Batch row `row` of a forked cache, as a one-row cache."""
        out = SplitKVCache(self.layer_indices, self.max_positions)
        for i in self._keys:
            out._keys[i] = self._keys[i][row : row + 1].clone()
            out._values[i] = self._values[i][row : row + 1].clone()
            out._used[i] = self._used[i]
        out.positions = self.positions.clone()
        return out

    def _truncate_layers(self, n: int) -> None:
        for i, used in self._used.items():
            self._used[i] = min(used, n)

    def reset(self) -> None:
        self._keys.clear()
        self._values.clear()
        self._used.clear()
        self.positions = torch.empty(0, dtype=torch.long)

    def nbytes(self) -> int:
        """Bytes the cached positions take (not the buffers' spare capacity)."""
        return sum(t.numel() * t.element_size() for i in self._keys for t in self.layer(i))


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    # a buffer allocated in a pass under inference_mode is written to outside it too (a token tree's keep)
    with torch.inference_mode() if dst.is_inference() else contextlib.nullcontext():
        dst.copy_(src)


def _check_supported(model: nn.Module) -> None:
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if (
        mt not in _SUPPORTED
        or inner is None
        or any(not hasattr(inner, a) for a in needed)
        or not hasattr(model, "lm_head")
    ):
        raise TypeError(
            f"split supports Llama/Qwen2-family causal LMs ({', '.join(_SUPPORTED)}) with model.model."
            f"{{embed_tokens,layers,norm,rotary_emb}} and lm_head; got model_type={mt!r} ({type(model).__name__})"
        )


def mask_on(mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return mask if mask is None or mask.device == device else mask.to(device)


class LayerStack(nn.Module):
    """Runs a contiguous run of decoder-layer-like modules against a SplitKVCache.

    Each module is called like a HF decoder layer (hidden, attention_mask=, position_embeddings=, position_ids=,
    past_key_values=, use_cache=) and its attention's `layer_idx` must lie in `layer_range`. The adapter reuses this
    with its single attention block.
    """

    def __init__(
        self,
        config: Any,
        rotary_emb: nn.Module,
        layers: list[nn.Module],
        layer_range: range,
        layer_types: list[str] | None = None,
    ) -> None:
        super().__init__()
        if len(layers) != len(layer_range):
            raise ValueError(f"{len(layers)} layers for layer range {layer_range}")
        self.config = config
        self.layer_range = layer_range
        self.layers = nn.ModuleList(layers)  # shared modules, not copies
        self.rotary_emb = rotary_emb
        self.layer_types = list(layer_types or ["full_attention"] * len(layers))
        self.sliding_window: int | None = getattr(config, "sliding_window", None)

    @classmethod
    def from_model(cls, model: nn.Module, start: int, end: int) -> LayerStack:
        cfg = model.config
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        return cls(
            cfg, model.model.rotary_emb, list(model.model.layers[start:end]), range(start, end), types[start:end]
        )

    def new_cache(self, max_positions: int | None = None) -> SplitKVCache:
        return SplitKVCache(self.layer_range, max_positions)

    def _positions(self, cache: SplitKVCache, n: int, positions: torch.Tensor | int | None) -> torch.Tensor:
        if positions is None:
            positions = cache.next_position
        if isinstance(positions, int):
            return torch.arange(positions, positions + n, dtype=torch.long)
        positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
        if positions.numel() != n:
            raise ValueError(f"{positions.numel()} positions for {n} tokens")
        return positions

    def _mask(
        self,
        key_pos: torch.Tensor,
        query_pos: torch.Tensor,
        dtype: torch.dtype,
        window: int | None,
        among_new: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        allowed = key_pos[None, :] <= query_pos[:, None]
        if window is not None:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        if among_new is not None:  # a token tree: a node sees the cache and its ancestors, not its siblings
            n = query_pos.numel()
            allowed[:, -n:] &= among_new
        if query_pos.numel() == 1 and bool(allowed.all()):
            return None  # one query seeing everything: no mask, the same kernel path HF's own decode step takes
        mask = torch.zeros(allowed.shape, dtype=dtype)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None]  # [1, 1, q, kv], additive: works for sdpa and eager attention

    def masks(
        self,
        key_pos: torch.Tensor,
        query_pos: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        among_new: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor | None]:
        """The position rule's mask per layer type (None: no mask needed), queries at `query_pos` against keys at
        `key_pos` (the new tokens last); sliding-attention layers see only the last `sliding_window` positions.
        `among_new` (bool [n, n]) further limits which new tokens each new token sees (a tree's ancestor mask)."""
        windows = {t: self.sliding_window if t == "sliding_attention" else None for t in set(self.layer_types)}
        return {t: mask_on(self._mask(key_pos, query_pos, dtype, w, among_new), device) for t, w in windows.items()}

    def run(
        self,
        hidden: torch.Tensor,
        cache: SplitKVCache | None,
        positions: torch.Tensor | int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden [batch, tokens, hidden] -> same shape after these layers; appends to `cache` if given.

        `attention_mask` overrides the position rule: a bool [tokens, cached + tokens] (True = may attend),
        e.g. for tree-shaped drafts.
        """
        squeeze = hidden.dim() == 2
        if squeeze:
            hidden = hidden.unsqueeze(0)
        param = next(self.layers.parameters(), None)
        if param is not None and hidden.dtype != param.dtype:
            hidden = hidden.to(param.dtype)  # e.g. states that crossed the wire as float16
        batch, n, _ = hidden.shape
        if cache is None:
            cache_pos = torch.empty(0, dtype=torch.long)
            pos = self._positions(SplitKVCache(self.layer_range), n, positions)
        else:
            cache_pos = cache.positions
            pos = self._positions(cache, n, positions)
        key_pos = torch.cat([cache_pos, pos])  # positions and masks are built on the CPU, then moved
        position_ids = pos[None].expand(batch, n).to(hidden.device)
        pos_emb = self.rotary_emb(hidden, position_ids)
        if attention_mask is not None:
            am = torch.as_tensor(attention_mask, dtype=torch.bool)
            if am.shape != (n, key_pos.numel()):
                raise ValueError(f"attention_mask must be [{n}, {key_pos.numel()}], got {tuple(am.shape)}")
            full = torch.zeros(am.shape, dtype=hidden.dtype).masked_fill_(~am, torch.finfo(hidden.dtype).min)
            masks = {t: full[None, None].to(hidden.device) for t in set(self.layer_types)}
        else:
            masks = self.masks(key_pos, pos, hidden.dtype, hidden.device)
        # A throwaway cache when none is given: the layers still need somewhere to put this step's keys.
        kv = cache if cache is not None else SplitKVCache(self.layer_range)
        try:
            for layer, ltype in zip(self.layers, self.layer_types, strict=True):
                hidden = layer(
                    hidden,
                    attention_mask=masks[ltype],
                    position_embeddings=pos_emb,
                    position_ids=position_ids,
                    past_key_values=kv,
                    use_cache=True,
                )
        except BaseException:
            if cache is not None:  # leave the cache as it was: no half-appended layers
                cache.restore(cache_pos)
            raise
        if cache is not None:
            cache.positions = key_pos
        return hidden.squeeze(0) if squeeze else hidden


class InputSubmodel(nn.Module):
    """Embedding + the first m decoder layers: token ids -> shallow hidden states (runs on the device)."""

    def __init__(self, model: nn.Module, m: int) -> None:
        super().__init__()
        self.embed_tokens = model.model.embed_tokens
        self.stack = LayerStack.from_model(model, 0, m)

    def new_cache(self) -> SplitKVCache:
        return self.stack.new_cache()

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: SplitKVCache | None = None,
        positions: torch.Tensor | int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        return self.stack.run(self.embed_tokens(ids), cache, positions, attention_mask)


class MiddleSubmodel(nn.Module):
    """Decoder layers m..n-1: shallow hidden states -> deep hidden states (runs on the cloud worker)."""

    def __init__(self, model: nn.Module, m: int) -> None:
        super().__init__()
        self.stack = LayerStack.from_model(model, m, model.config.num_hidden_layers)

    def new_cache(self, max_positions: int | None = None) -> SplitKVCache:
        return self.stack.new_cache(max_positions)

    def forward(
        self,
        hidden: torch.Tensor,
        cache: SplitKVCache | None = None,
        positions: torch.Tensor | int | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.stack.run(hidden, cache, positions, attention_mask)


class OutputSubmodel(nn.Module):
    """Final norm + LM head: deep hidden states -> logits (runs on the device). Stateless: no KV cache."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.norm = model.model.norm
        self.lm_head = model.lm_head

    def forward(self, hidden: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """`normed=True` when `hidden` already went through the final norm (e.g. HF's last_hidden_state)."""
        hidden = hidden.to(self.lm_head.weight.dtype)
        return self.lm_head(hidden if normed else self.norm(hidden))


@dataclass
class SplitModel:
    """The three submodels of one model split after layer m, plus facts the wire and worker need."""

    input: InputSubmodel
    middle: MiddleSubmodel
    output: OutputSubmodel
    m: int
    num_layers: int
    hidden_size: int
    vocab_size: int

    def session(self) -> SplitSession:
        return SplitSession(self)


def split_model(model: nn.Module, m: int = DEFAULT_SPLIT_LAYERS) -> SplitModel:
    """Split a HF Llama/Qwen2-family causal LM after decoder layer m (HAT default m = 2)."""
    _check_supported(model)
    n = model.config.num_hidden_layers
    if not 1 <= m < n:
        raise ValueError(f"m must be in [1, {n - 1}] for a {n}-layer model, got {m}")
    return SplitModel(
        input=InputSubmodel(model, m),
        middle=MiddleSubmodel(model, m),
        output=OutputSubmodel(model),
        m=m,
        num_layers=n,
        hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size,
    )


class SplitSession:
    """Both halves in one process, each with its own cache: the reference the device and worker must match.

    Useful for tests, for the HAT device's own bookkeeping, and for running a split model without a network.
    """

    def __init__(self, split: SplitModel) -> None:
        self.split = split
        self.input_cache = split.input.new_cache()
        self.middle_cache = split.middle.new_cache()

    def __len__(self) -> int:
        return len(self.input_cache)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor | list[int], positions: torch.Tensor | int | None = None) -> torch.Tensor:
        """Append tokens (one chunk, one decode step, or several draft tokens); logits [batch, tokens, vocab]."""
        shallow = self.split.input(torch.as_tensor(input_ids), self.input_cache, positions)
        deep = self.split.middle(shallow, self.middle_cache, positions)
        return self.split.output(deep)

    def prefill(self, input_ids: torch.Tensor | list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Prefill in one shot or in chunks; returns logits for all prompt positions."""
        ids = torch.as_tensor(input_ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        step = chunk_size or ids.shape[1]
        outs = [self.forward(ids[:, i : i + step]) for i in range(0, ids.shape[1], step)]
        return torch.cat(outs, dim=1)

    def rollback(self, n: int) -> None:
        """Keep only the first n positions in both caches."""
        self.input_cache.crop(n)
        self.middle_cache.crop(n)


@torch.inference_mode()
def full_forward(model: nn.Module, input_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """Reference logits [batch, tokens, vocab] from the unsplit model (no cache)."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    return model(input_ids=ids, use_cache=False).logits


def compare_with_full(
    model: nn.Module, split: SplitModel, input_ids: torch.Tensor | list[int], chunk_size: int | None = None
) -> float:
    """Max |logits_split - logits_full| over all positions, prefilling the split model one-shot or in chunks."""
    ref = full_forward(model, input_ids)
    got = split.session().prefill(input_ids, chunk_size)
    return float((got - ref).abs().max())
