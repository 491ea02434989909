"""The HAT adapter on a tiny random Llama (no weights needed): structure and caching. Its training and
persistence are tested with the trainer (tests/unit/test_train_adapter.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from clients.hat.adapter import Adapter
from clients.hat.split import split_model


def test_adapter_is_a_copy_of_layer_m_attention(tiny: LlamaForCausalLM) -> None:
    ad = Adapter(tiny, m=2)
    src = tiny.model.layers[2].self_attn
    assert torch.equal(ad.block.self_attn.q_proj.weight, src.q_proj.weight)
    assert ad.block.self_attn.q_proj.weight.data_ptr() != src.q_proj.weight.data_ptr()
    assert sum(p.numel() for p in ad.parameters()) == sum(p.numel() for p in src.parameters()) + 32  # + its norm
    assert Adapter(tiny, m=2, init_from=3).init_from == 3
    rnd = Adapter(tiny, m=2, random_init=True)
    assert not torch.equal(rnd.block.self_attn.q_proj.weight, src.q_proj.weight)
    with pytest.raises(ValueError):
        Adapter(tiny, m=2, init_from=9)


@torch.inference_mode()
def test_cached_drafting_equals_full_sequence(tiny: LlamaForCausalLM) -> None:
    split = split_model(tiny, 2)
    ad = Adapter(tiny, m=2)
    ids = torch.randint(0, 96, (1, 12))
    shallow = split.input(ids)
    full = ad(shallow)
    assert full.shape == shallow.shape

    cache = ad.new_cache()
    parts = [ad(shallow[:, :7], cache)] + [ad(shallow[:, i : i + 1], cache) for i in range(7, 12)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)
    cache.crop(9)  # rejected drafts: roll back like the other caches
    assert torch.allclose(ad(shallow[:, 9:], cache), full[:, 9:], atol=1e-5)
