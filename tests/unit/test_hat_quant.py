"""The device half's int8 drafting weights (clients/hat/quant.py): what they compute, that a row's result does not
depend on the other rows of the call (the drafting station batches streams' rows), and that only drafting weights
change."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from clients.hat.half import REFINED, DeviceHalf
from clients.hat.quant import ArgmaxHead, Int8Linear, Int8Rows, int8_available, quantize_projections
from clients.hat.ragged import project_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def test_int8_rows_compute_with_the_quantized_weight() -> None:
    assert int8_available()  # the pinned torch has the kernel: the default draft_precision runs it
    torch.manual_seed(0)
    w = torch.randn(300, 64) * 0.05
    rows = Int8Rows(w)
    deq = rows.dequantized()
    # per-row symmetric quantization: every weight within half a step of its row's scale
    step = rows.scale.float()[:, None]
    assert ((deq - w).abs() <= step / 2 + 1e-7).all()
    assert rows.qweight.dtype == torch.int8 and int(rows.qweight.abs().max()) <= 127
    x = torch.randn(5, 64)
    got = rows(x)
    assert got.dtype == torch.float32 and got.shape == (5, 300)
    # bfloat16 activations and output: close to the dequantized weight's fp32 product, not to the bit
    ref = x @ deq.T
    assert torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_a_rows_result_does_not_depend_on_the_other_rows() -> None:
    torch.manual_seed(1)
    rows = Int8Rows(torch.randn(1000, 96))
    x = torch.randn(9, 96)
    alone = torch.cat([rows(x[i : i + 1]) for i in range(9)])
    for n in range(1, 10):
        assert torch.equal(rows(x[:n]), alone[:n]), n


def test_int8_linear_replaces_a_linear_and_keeps_its_bias_and_dtype() -> None:
    torch.manual_seed(2)
    block = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Sequential(nn.Linear(48, 16, bias=False)))
    x = torch.randn(2, 3, 32)
    ref = block(x)
    assert quantize_projections(block) == 2
    assert isinstance(block[0], Int8Linear) and isinstance(block[2][0], Int8Linear)
    out = block(x)
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert torch.allclose(out, ref, atol=0.05)
    # the drafting station's ragged forward projects through project_rows: the module's own rows
    assert torch.equal(project_rows(block[0], x[:1]), block[0](x[:1]))


def test_quantize_drafting_touches_only_drafting_weights(tiny, tmp_path) -> None:
    half = DeviceHalf.load(tiny, 2)
    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"token_ids": list(range(0, 96, 3))}))
    half.load_draft_vocab(vocab, eos_ids={1})
    torch.manual_seed(3)
    feats = torch.randn(3, half.hidden_size)
    fp32_draft = half.draft_logits(feats, 0)
    fp32_verify = half.head_rows(feats)
    input_params = {k: v.clone() for k, v in half.input.state_dict().items()}
    shallow = torch.randn(1, 5, half.hidden_size)
    fp32_adapted = half.adapter(shallow)

    assert half.quantize_drafting()
    attn = half.adapter.block.self_attn
    assert all(isinstance(getattr(attn, p), Int8Linear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    adapted = half.adapter(shallow)  # the model's own attention forward, through the int8 projections
    assert adapted.dtype == torch.float32 and torch.allclose(adapted, fp32_adapted, atol=0.05)
    assert not torch.equal(adapted, fp32_adapted)
    draft = half.draft_logits(feats, 0)
    outside = torch.ones(half.vocab_size, dtype=torch.bool)
    outside[half.draft_ids] = False
    assert torch.isinf(draft[:, outside]).all() and torch.isfinite(draft[:, ~outside]).all()
    assert torch.allclose(draft[:, ~outside], fp32_draft[:, ~outside], atol=0.05)
    assert not torch.equal(draft, fp32_draft)  # it is the int8 head that ran
    # verification and the input layers are untouched, bit for bit
    assert torch.equal(half.head_rows(feats), fp32_verify)
    assert all(torch.equal(v, input_params[k]) for k, v in half.input.state_dict().items())
    # the model's own layer m (the adapter was copied from it) keeps its fp32 projections
    assert isinstance(tiny.model.layers[2].self_attn.q_proj, nn.Linear)


def test_the_int8_draft_heads_best_rows_are_exact_fp32(tiny) -> None:
    """The int8 kernel's bfloat16 scores tie near the top; the best rows are recomputed in fp32, so the draft's pick
    and confidence are the fp32 head's wherever its argmax is among them — row by row, whatever else is in the call."""
    half = DeviceHalf.load(tiny, 2)
    torch.manual_seed(4)
    feats = torch.randn(6, half.hidden_size)
    fp32 = half.draft_logits(feats, 0)
    assert half.quantize_drafting()
    got = half.draft_logits(feats, 0)
    top = got.topk(REFINED, dim=-1).indices
    normed = half.output.norm(feats)
    exact = (half.output.lm_head.weight[top] * normed[:, None, :]).sum(-1)
    assert torch.equal(got.gather(1, top), exact)
    assert torch.allclose(exact, fp32.gather(1, top), atol=1e-5)
    assert torch.equal(got.argmax(-1), fp32.argmax(-1))
    alone = torch.cat([half.draft_logits(feats[i : i + 1], 0) for i in range(6)])
    assert torch.equal(got, alone)


def near_twins(rows: int = 4000, width: int = 64) -> torch.Tensor:
    """A head whose rows come in pairs a hair apart: int8 rounds both twins alike, so int8 scores alone pick the wrong
    twin (or tie) where the fp32 scores differ by less than the quantization error."""
    torch.manual_seed(5)
    base = torch.randn(rows // 2, width) * 0.05
    return torch.cat([base, base + torch.randn_like(base) * 2e-4])


def test_the_argmax_head_is_the_fp32_argmax_where_int8_alone_is_not() -> None:
    weight, bias = near_twins(), torch.randn(4000) * 0.01
    head = ArgmaxHead(weight, bias)
    torch.manual_seed(6)
    x = torch.randn(200, 64) * 3
    exact = torch.stack([head.exact(row, slice(None)) for row in x])
    approx = head.rows(x) + bias
    assert (approx.argmax(-1) != exact.argmax(-1)).sum() > 10  # int8 alone would be wrong here
    assert torch.equal(head(x).argmax(-1), exact.argmax(-1))
    for row, a, e in zip(x, approx, exact, strict=True):  # the bound holds, with room
        assert ((e - a).abs() * 2 <= head.bound(row, a - bias)).all()
    assert head.candidates < 200 * 40  # a few rows recomputed a state, not the head
    assert head.sound(x[:4])


def test_the_argmax_heads_rows_do_not_depend_on_the_other_rows() -> None:
    head = ArgmaxHead(near_twins())
    torch.manual_seed(7)
    x = torch.randn(9, 64) * 3
    alone = torch.cat([head(x[i : i + 1]) for i in range(9)])
    for n in range(1, 10):
        assert torch.equal(head(x[:n]), alone[:n]), n
    # the reference scores of a row are the same whichever other rows are asked for with it
    rows = torch.tensor([3, 2001, 17])
    assert torch.equal(head.exact(x[0], rows), head.exact(x[0], slice(None))[rows])


def test_quantize_head_serves_argmax_picks_and_leaves_the_fp32_head(tiny, monkeypatch) -> None:
    half = DeviceHalf.load(tiny, 2)
    torch.manual_seed(8)
    deep = torch.randn(5, half.hidden_size)
    fp32 = half.head_rows(deep)
    assert torch.equal(half.argmax_rows(deep), fp32)  # no int8 head yet: the fp32 one
    assert half.quantize_head()
    got = half.argmax_rows(deep)
    assert not torch.equal(got, fp32)  # the int8 head ran
    normed = half.output.norm(deep)
    reference = torch.stack([half.argmax_head.exact(row, slice(None)) for row in normed])
    assert torch.equal(got.argmax(-1), reference.argmax(-1))
    assert torch.equal(half.head_rows(deep), fp32)  # every other pick's head, bit for bit

    # another device half over the same model shares the head built for it, while the weight is unchanged
    again = DeviceHalf.load(tiny, 2)
    assert again.quantize_head() and again.argmax_head is half.argmax_head

    # a kernel less precise than the bound assumes (here: every score off by 1) is refused at load; the weight changed
    # in place, so the head is built (and checked) again
    with torch.no_grad():
        tiny.lm_head.weight.mul_(1.0)
    fresh = DeviceHalf.load(tiny, 2)
    monkeypatch.setattr(Int8Rows, "__call__", lambda self, x: x.float() @ self.dequantized().T + 1.0)
    assert not fresh.quantize_head() and fresh.argmax_head is None
    assert torch.equal(fresh.argmax_rows(deep), fp32)
