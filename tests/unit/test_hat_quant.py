"""The device half's int8 drafting weights (clients/hat/quant.py): what they compute, that a row's result does not
depend on the other rows of the call (the drafting station batches streams' rows), and that only drafting weights
change."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from clients.hat.half import REFINED, DeviceHalf
from clients.hat.quant import Int8Linear, Int8Rows, int8_available, quantize_projections
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
