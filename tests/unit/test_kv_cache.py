"""The split KV cache's buffers and the ragged forward's grouped-query attention, on a tiny random Llama."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import repeat_kv

from clients.hat.ragged import RaggedMiddle, grouped_attention, project_each_row, project_rows
from clients.hat.split import SplitKVCache, split_model

H = 32  # the hidden size of conftest's `tiny` model


pytestmark = pytest.mark.usefixtures("one_thread")


def append(cache: SplitKVCache, n: int, layers: range, batch: int = 1) -> list[torch.Tensor]:
    """n new positions in every layer (random keys, values = keys + 1); the new keys per layer."""
    new = []
    for i in layers:
        k = torch.randn(batch, 2, n, 4)
        cache.update(k, k + 1, i)
        new.append(k)
    first = cache.next_position
    cache.positions = torch.cat([cache.positions, torch.arange(first, first + n)])
    return new


def test_appends_within_capacity_reuse_the_buffer_and_growth_is_geometric() -> None:
    cache = SplitKVCache(range(0, 1))
    keys, views = [], []
    for _ in range(1000):
        k = torch.randn(1, 2, 1, 4)
        views.append(cache.update(k, k + 1, 0))  # held, so a freed buffer's address cannot come back
        keys.append(k)
        cache.positions = torch.arange(len(keys))
    starts = [kk.data_ptr() for kk, _ in views]
    # a copy of the whole context on every append (torch.cat) gave each of the 1000 appends new storage
    assert len(set(starts)) <= 12
    assert sum(a != b for a, b in itertools.pairwise(starts)) == len(set(starts)) - 1
    got_k, got_v = cache.layer(0)
    assert torch.equal(got_k, torch.cat(keys, dim=-2)) and torch.equal(got_v, torch.cat(keys, dim=-2) + 1)
    assert cache.nbytes() == 2 * got_k.numel() * got_k.element_size()


def test_capacity_never_grows_past_max_positions() -> None:
    cache = SplitKVCache(range(0, 1), max_positions=100)
    for _ in range(10):
        append(cache, 10, range(0, 1))
        assert cache._keys[0].shape[-2] <= 100  # the worker's KV reserve is max_context positions a session
    assert len(cache) == 100 and cache.layer(0)[0].shape[-2] == 100


def test_crop_restore_keep_fork_and_row_keep_their_semantics() -> None:
    layers = range(3, 5)
    cache = SplitKVCache(layers)
    ref = [torch.cat(ks, dim=-2) for ks in zip(*(append(cache, n, layers) for n in (5, 3, 4)), strict=True)]

    cache.crop(7)
    for i, r in zip(layers, ref, strict=True):
        assert torch.equal(cache.layer(i)[0], r[:, :, :7]) and torch.equal(cache.layer(i)[1], r[:, :, :7] + 1)
    again = append(cache, 2, layers)  # after a rollback the next append overwrites the dropped positions
    for i, r, a in zip(layers, ref, again, strict=True):
        assert torch.equal(cache.layer(i)[0], torch.cat([r[:, :, :7], a], dim=-2))

    before = cache.positions
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 3)  # a forward that failed after one layer
    cache.restore(before)
    assert all(cache.layer(i)[0].shape[-2] == 9 for i in layers)

    want = {i: cache.layer(i)[0][:, :, [0, 2, 8]] for i in layers}
    cache.keep([0, 2, 8])
    assert cache.positions.tolist() == [0, 2, 8]
    for i in layers:
        assert torch.equal(cache.layer(i)[0], want[i]) and torch.equal(cache.layer(i)[1], want[i] + 1)

    forked = cache.fork(3, 2)
    assert len(forked) == 2 and forked.positions.tolist() == [0, 2]
    assert torch.equal(forked.layer(3)[0], want[3][:, :, :2].expand(3, -1, -1, -1))
    with pytest.raises(ValueError):  # a one-row append would broadcast into every row
        forked.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 3)
    step = append(forked, 1, layers, batch=3)
    one = forked.row(1)
    assert torch.equal(one.layer(3)[0], torch.cat([want[3][:, :, :2], step[0][1:2]], dim=-2))
    append(one, 1, layers)
    assert forked.layer(3)[0].shape[-2] == 3  # the row is a copy
    assert len(cache) == 3 and cache.layer(3)[0].shape[-2] == 3  # forking left the source alone


@pytest.mark.parametrize(("n", "ctx", "masked"), [(1, 9, False), (4, 9, True), (6, 40, True)])
def test_grouped_attention_equals_the_expanded_reference(n: int, ctx: int, masked: bool) -> None:
    torch.manual_seed(n)
    heads, kv_heads, d = 6, 2, 8
    buf_k, buf_v = torch.randn(1, kv_heads, ctx + 10, d), torch.randn(1, kv_heads, ctx + 10, d)
    k, v = buf_k[:, :, :ctx], buf_v[:, :, :ctx]  # the cache's views of its buffers: not contiguous
    q = torch.randn(1, heads, n, d)
    mask = None
    if masked:  # causal over the last n positions and a window of 5, as the split's position rule builds it
        qp, kp = torch.arange(ctx - n, ctx), torch.arange(ctx)
        allowed = (kp[None] <= qp[:, None]) & (kp[None] > qp[:, None] - 5)
        mask = torch.zeros(n, ctx).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k.contiguous(), 3), repeat_kv(v.contiguous(), 3), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    grouped = None if mask is None else mask.repeat(1, 1, 3, 1)
    got = grouped_attention(q, k, v, grouped, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_grouped_attention_takes_a_kernel_output_in_any_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's fused SDPA kernels return [b, kv_heads, rows, d] as a transposed view of [b, rows, kv_heads, d] storage
    (seen on an H100: the worker's start-up check failed on a `view` of it); the result must not depend on that."""
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    want = grouped_attention(q, k, v, None, 0.3)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def fused_layout(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, the fused kernels' strides

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fused_layout)
    assert not fused_layout(q.reshape(1, 2, 12, 8), k, v).is_contiguous()
    torch.testing.assert_close(grouped_attention(q, k, v, None, 0.3), want, rtol=0, atol=0)


def test_ragged_forward_matches_the_models_layers_and_the_eager_path(tiny: LlamaForCausalLM) -> None:
    torch.manual_seed(2)
    middle = split_model(tiny, 2).middle
    eager_model = copy.deepcopy(tiny)
    eager_model.config._attn_implementation = "eager"
    eager_middle = split_model(eager_model, 2).middle
    xs = [torch.randn(n, H) for n in (9, 1, 4)]
    with torch.inference_mode():
        ref = middle(torch.cat(xs)[None], middle.new_cache())[0]
        outs = {}
        for name, mid in (("sdpa", middle), ("eager", eager_middle)):
            ragged, cache = RaggedMiddle(mid.stack), mid.new_cache()
            assert ragged._grouped == (name == "sdpa")
            outs[name] = torch.cat([ragged.forward([(x, cache)])[0] for x in xs])
    torch.testing.assert_close(outs["sdpa"], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["eager"], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("project", [project_each_row, project_rows], ids=["each row", "4-row chunks"])
def test_a_draft_steps_rows_are_the_same_alone_and_beside_other_streams(tiny: LlamaForCausalLM, project) -> None:
    """The drafting station's draft steps (one row per stream, HATOptions.draft_step_rows): a stream's row is bit for
    bit what it is alone, whichever other streams share the pass, and the model's own layers' result."""
    torch.manual_seed(4)
    stack = split_model(tiny, 2).input
    ragged = RaggedMiddle(stack.stack)
    contexts = [torch.randn(n, H) for n in (7, 3, 12)]
    steps = [torch.randn(1, H) for _ in contexts]

    def caches() -> list[SplitKVCache]:
        out = []
        for ctx in contexts:
            cache = stack.new_cache()
            ragged.forward([(ctx, cache)])
            out.append(cache)
        return out

    with torch.inference_mode():
        alone = [ragged.forward([(x, c)], project=project)[0] for x, c in zip(steps, caches(), strict=True)]
        for group in ([0, 1], [2, 0, 1], [1, 2]):
            fresh = caches()
            together = ragged.forward([(steps[i], fresh[i]) for i in group], project=project)
            assert all(torch.equal(out, alone[i]) for i, out in zip(group, together, strict=True)), group
        modules = [ragged.forward([(x, c)])[0] for x, c in zip(steps, caches(), strict=True)]  # the layers' linears
    for got, want in zip(alone, modules, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    linear = torch.nn.Linear(H, 8)  # with a bias, as Qwen's q/k/v projections have
    x = torch.randn(1, 3, H)
    with torch.inference_mode():
        torch.testing.assert_close(project_each_row(linear, x), linear(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(project_each_row(linear, x)[:, 1:2], project_each_row(linear, x[:, 1:2]))


def test_a_failed_ragged_forward_leaves_every_cache_as_it_was(tiny: LlamaForCausalLM) -> None:
    torch.manual_seed(3)
    middle = split_model(tiny, 2).middle
    ragged = RaggedMiddle(middle.stack)
    a, b = middle.new_cache(), middle.new_cache()
    xa, xb, more = torch.randn(5, H), torch.randn(3, H), torch.randn(2, H)
    with torch.inference_mode():
        ragged.forward([(xa, a), (xb, b)])
        saved = {i: [t.clone() for t in a.layer(i)] for i in middle.stack.layer_range}
        last = ragged.layers[-1]
        last.mlp.forward = lambda h: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
        try:
            with pytest.raises(RuntimeError, match="boom"):
                ragged.forward([(more, a), (more, b)])
        finally:
            del last.mlp.forward
        assert len(a) == 5 and len(b) == 3
        for i, (k, v) in saved.items():
            assert torch.equal(a.layer(i)[0], k) and torch.equal(a.layer(i)[1], v)
        fresh = middle.new_cache()
        ragged.forward([(xa, fresh)])
        assert torch.equal(ragged.forward([(more, a)])[0], ragged.forward([(more, fresh)])[0])


def test_a_cache_filled_under_inference_mode_is_rolled_back_and_extended_outside_it() -> None:
    """The worker's passes run under inference_mode; a token tree's keep (and a device's next step) may not."""
    cache = SplitKVCache(range(0, 1))
    with torch.inference_mode():
        append(cache, 4, range(0, 1))
    want = cache.layer(0)[0][:, :, [0, 3]].clone()
    cache.keep([0, 3])
    assert torch.equal(cache.layer(0)[0], want)
    append(cache, 1, range(0, 1))  # into the inference-mode buffer
    append(cache, 100, range(0, 1))  # past it
    assert len(cache) == 103 and torch.equal(cache.layer(0)[0][:, :, :2], want)
