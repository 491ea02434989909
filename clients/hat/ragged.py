"""The HAT worker's batched middle forward: several sessions' new tokens through layers m..n-1 in one pass.

Continuous, "ragged" batching: all token rows of all sessions are packed into one [1, N, hidden] tensor, so
every weight matmul (q/k/v/o projections, MLP) and norm runs once for the whole batch; attention runs per
session against that session's own KV cache, with per-row positions (rotary) and the session's own causal mask.
This is the varlen/ragged layout of vLLM-style continuous batching rather than a padded [B, T] batch: no
compute is spent on padding (a 256-token prefill chunk and a 2-token verification share one pass without the
verification row being padded to 256), and no session can see another's keys. Rows are never concatenated
into one attention sequence. Attention (sdpa, HF's default) runs the query heads that share a KV head as one head
over the cache's K/V (`grouped_attention`): the grouped K/V are never expanded, and the cache appends in place
(SplitKVCache's buffers), so a piece's cost past the weights grows with its rows × context, not with the context
once per pass.

Batch invariance: nothing is shared between sessions except the weights, so a row's result does not depend on
its neighbours — with one intra-op thread and the packed matrix padded to >= `min_rows` rows (BLAS switches from
a per-row to a blocked kernel below 4 rows on this CPU), a session's deep states are bit-identical whether it ran
alone or in a batch (tested). With more threads BLAS may split rows differently: equal to ~1e-6, not bitwise.
`batch_invariant=False` skips the padding of a lone 1-token row (plain U-shape decode, ~1.8x faster on that
case) at the price of that guarantee. The forward is written here (it calls the HF layer's submodules: norms,
projections, rotary, the model's attention function, MLP) rather than through the layers' own forward, so the
worker checks it against the model's layers at start-up and an unsupported layer layout fails loudly.

The device half's drafting station (clients/hat/station.py) runs the same forward over its input layers and the
draft adapter (an attention-only block: no MLP) for several streams at once. Its draft steps (a row per stream) give
the forward a `project`: `project_each_row` (each row its own matrix-vector product) or `project_rows` (fixed 4-row
chunks); either way a row's result does not depend on the other rows, so the forward adds no padding of its own. It
projects verification rows through a head with `rows_linear`, batch-invariant the same way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from clients.hat.quant import Int8Linear
from clients.hat.split import LayerStack, SplitKVCache
from policies.trees import ancestor_mask, tree_depths


def ancestor_tensor(parents: Sequence[int]) -> torch.Tensor:
    """bool [w, w]: node i may attend to node j (j is i or an ancestor of i)."""
    return torch.tensor(ancestor_mask(parents), dtype=torch.bool)


class RaggedMiddle:
    """The middle layers run over several sessions' new tokens in one pass (see the module docstring)."""

    def __init__(self, stack: LayerStack, min_rows: int = 4, batch_invariant: bool = True) -> None:
        self.stack = stack
        self.batch_invariant = batch_invariant
        self.layers = list(stack.layers)
        self.layer_types = list(stack.layer_types)
        self.min_rows = max(1, min_rows)
        if not self.layers:
            raise ValueError("the middle submodel has no layers")
        needed = ("input_layernorm", "self_attn")
        for layer in self.layers:
            attn = getattr(layer, "self_attn", None)
            # a decoder layer has both of the feed-forward half's modules; an attention-only block (the adapter) neither
            halves = hasattr(layer, "post_attention_layernorm") == hasattr(layer, "mlp")
            if (
                any(not hasattr(layer, a) for a in needed)
                or not halves
                or any(not hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
            ):
                raise TypeError(f"{type(layer).__name__} is not a Llama/Qwen-style decoder layer")
        attn0 = self.layers[0].self_attn
        module = sys.modules[type(attn0).__module__]
        self._rotary = module.apply_rotary_pos_emb
        self._eager = getattr(module, "eager_attention_forward", None)
        # sdpa (HF's default) runs as grouped_attention; another implementation the config asks for (eager, flash
        # kernels) runs as the model's own function, with its own expansion of grouped K/V
        self._grouped = (getattr(attn0.config, "_attn_implementation", None) or "sdpa") == "sdpa"
        self._groups = int(getattr(attn0, "num_key_value_groups", 1))
        param = next(self.layers[0].parameters())
        self.dtype, self.device = param.dtype, param.device

    def _attention_fn(self, attn: Any) -> Callable[..., Any]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        impl = getattr(attn.config, "_attn_implementation", None) or "sdpa"
        if impl == "eager" and self._eager is not None:
            return self._eager
        return ALL_ATTENTION_FUNCTIONS.get_interface(impl, self._eager)

    def _group_masks(self, masks: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """A session's masks for grouped_attention: each query row's mask once per query head of a KV head."""
        if not self._grouped or self._groups == 1:
            return masks
        return {t: None if m is None else m.repeat(1, 1, self._groups, 1) for t, m in masks.items()}

    def forward(
        self,
        rows: list[tuple[torch.Tensor, SplitKVCache]],
        trees: list[Sequence[int] | None] | None = None,
        project: Project | None = None,
    ) -> list[torch.Tensor]:
        """rows: (shallow states [n_i, hidden], the session's cache). Appends to every cache; deep states per row.

        New tokens go at positions len(cache) .. len(cache)+n_i-1 — or, for a row whose `trees` entry is a token
        tree's parent indices, node j at len(cache) + depth(j), attending to the cache and its own ancestors.
        On any exception every cache is left as it was.
        project(linear, x): how each linear projection is computed (e.g. `project_rows`); None = the module itself.
        """
        spans, key_pos, masks, pos_parts = [], [], [], []
        start = 0
        for r, (hidden, cache) in enumerate(rows):
            n = hidden.shape[0]
            first = len(cache)
            parents = trees[r] if trees is not None else None
            among = None
            if parents is None:
                q_pos = torch.arange(first, first + n, dtype=torch.long)
            else:
                if len(parents) != n:
                    raise ValueError(f"a tree of {len(parents)} nodes for {n} rows")
                q_pos = first + torch.tensor(tree_depths(parents), dtype=torch.long)
                among = ancestor_tensor(parents)
            kp = torch.cat([cache.positions, q_pos])
            spans.append((start, start + n))
            key_pos.append(kp)
            pos_parts.append(q_pos)
            masks.append(self._group_masks(self.stack.masks(kp, q_pos, self.dtype, self.device, among)))
            start += n
        total = start
        # Padding fixes the module linears' kernel choice; a `project` keeps each row's result to itself already.
        pad = max(0, self.min_rows - total) if project is None and (self.batch_invariant or total > 1) else 0
        x = torch.cat([h.to(self.device, self.dtype) for h, _ in rows])
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[-1])])
            pos_parts.append(torch.zeros(pad, dtype=torch.long))
        x = x[None]
        position_ids = torch.cat(pos_parts)[None].to(self.device)
        cos, sin = self.stack.rotary_emb(x, position_ids)
        old = [c.positions for _, c in rows]
        try:
            for layer, ltype in zip(self.layers, self.layer_types, strict=True):
                x = self._layer(layer, ltype, x, cos, sin, rows, spans, masks, pad, project)
        except BaseException:
            for (_, cache), positions in zip(rows, old, strict=True):
                cache.restore(positions)
            raise
        for (_, cache), kp in zip(rows, key_pos, strict=True):
            cache.positions = kp
        return [x[0, s:e] for s, e in spans]

    def _layer(
        self,
        layer: Any,
        ltype: str,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rows: list[tuple[torch.Tensor, SplitKVCache]],
        spans: list[tuple[int, int]],
        masks: list[dict[str, torch.Tensor | None]],
        pad: int,
        project: Project | None = None,
    ) -> torch.Tensor:
        def lin(module: Any, h: torch.Tensor) -> torch.Tensor:
            return module(h) if project is None else project(module, h)

        attn = layer.self_attn
        width = x.shape[1]
        hs = layer.input_layernorm(x)
        shape = (1, width, -1, attn.head_dim)
        q = lin(attn.q_proj, hs).view(shape)
        k = lin(attn.k_proj, hs).view(shape)
        v = lin(attn.v_proj, hs).view(shape).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self._rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        fn = None if self._grouped else self._attention_fn(attn)
        extra = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
        pieces = []
        for (s, e), (_, cache), mask in zip(spans, rows, masks, strict=True):
            kk, vv = cache.update(k[:, :, s:e], v[:, :, s:e], attn.layer_idx)
            qq = q[:, :, s:e].contiguous()
            if fn is None:
                out = grouped_attention(qq, kk, vv, mask[ltype], attn.scaling)
            else:
                out, _ = fn(attn, qq, kk, vv, mask[ltype], dropout=0.0, scaling=attn.scaling, **extra)
            pieces.append(out.reshape(1, e - s, -1))
        if pad:
            pieces.append(x.new_zeros(1, pad, pieces[0].shape[-1]))
        h = x + lin(attn.o_proj, torch.cat(pieces, dim=1).contiguous())
        if not hasattr(layer, "mlp"):  # an attention-only block (the draft adapter)
            return h
        mlp, normed = layer.mlp, layer.post_attention_layernorm(h)
        if project is None or not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return h + mlp(normed)
        return h + lin(mlp.down_proj, mlp.act_fn(lin(mlp.gate_proj, normed)) * lin(mlp.up_proj, normed))


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Attention of q [b, heads, n, d] over grouped-query k, v [b, kv_heads, ctx, d] -> [b, n, heads, d_v].

    The query heads that share a KV head run as one head of n·(heads/kv_heads) rows against it, as HF's sdpa path
    does for a single row (pack_gqa), so K/V are never expanded (transformers' repeat_kv copied the whole context
    heads/kv_heads times per layer per pass). `mask`: [1, 1, n·groups, ctx] additive, each row's mask repeated per
    query head of a group (RaggedMiddle._group_masks), or None. The sliding window is the mask's part. On this CPU
    with one thread it also beats SDPA's own enable_gqa=True for pieces of a few rows (measured: 4 rows after 4000
    positions 0.7 ms against 1.0 ms a layer).
    """
    b, heads, n, d = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(b, kv_heads, heads // kv_heads * n, d)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scaling)
    return out.reshape(b, heads, n, v.shape[-1]).transpose(1, 2)


ROWS_CHUNK = 4
Project = Callable[[Any, torch.Tensor], torch.Tensor]  # (an nn.Linear, x [1, rows, in]) -> [1, rows, out]


def rows_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ weight[out, in]^T, batch-invariant and fast for a few rows: computed as weight @ chunk^T over
    chunks of exactly ROWS_CHUNK rows (the last padded with zeros), so every row goes through the same kernel with
    the same shape whatever else is in the batch. On this CPU (one thread) a row's result is then bit-identical
    alone or batched (tested), and a 4-row chunk of a 152k-row LM head costs less than F.linear on one row: the
    weight-left GEMM streams the weight once without packing it."""
    rows = x.shape[0]
    pad = -rows % ROWS_CHUNK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = [(weight @ x[i : i + ROWS_CHUNK].T).T for i in range(0, x.shape[0], ROWS_CHUNK)]
    return torch.cat(out)[:rows]


def project_each_row(linear: Any, x: torch.Tensor) -> torch.Tensor:
    """A RaggedMiddle `project`: nn.Linear `linear` over x [1, rows, in], each row on its own (a matrix-vector product,
    the same call whatever the other rows), so a row's result is what it is alone. One row costs a one-row linear's
    time, ~2.2x less than a 4-row chunk of `project_rows` on this CPU (one thread; Qwen2.5-0.5B's MLP projections: 0.66
    against 1.5 ms), and each further row as much again: the cheaper of the two for one or two rows. A quantized
    projection (Int8Linear, the adapter's) computes its rows itself, row-invariantly."""
    if isinstance(linear, Int8Linear):
        return linear(x)
    return torch.cat([F.linear(x[:, i : i + 1], linear.weight, linear.bias) for i in range(x.shape[1])], dim=1)


def project_rows(linear: Any, x: torch.Tensor) -> torch.Tensor:
    """A RaggedMiddle `project`: nn.Linear `linear` over x [1, rows, in] through rows_linear (batch-invariant: fixed
    4-row chunks, so up to four rows cost one chunk, ~2.2x a one-row linear on this CPU). A quantized projection
    (clients/hat/quant.py's Int8Linear, the adapter's) computes its rows itself, just as batch-invariantly."""
    if isinstance(linear, Int8Linear):
        return linear(x)
    out = rows_linear(x[0], linear.weight)
    if linear.bias is not None:
        out = out + linear.bias
    return out[None]
