"""The HAT adapter on a tiny random Llama (no weights needed): structure, caching, persistence, learning."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from clients.hat.adapter import Adapter, AdapterTrainer, TrainConfig, distillation_loss, teacher_example
from clients.hat.split import split_model


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


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


def test_loss_is_eq4(tiny: LlamaForCausalLM) -> None:
    split = split_model(tiny, 2)
    ex = teacher_example(split, torch.randint(0, 96, (10,)).tolist())
    loss, parts = distillation_loss(ex.deep, ex.deep, split, w_ce=0.1)
    assert parts["smooth_l1"] == 0.0
    with torch.no_grad():
        p = torch.softmax(split.output(ex.deep), -1)
    entropy = float(-(p * p.log()).sum(-1).mean())
    assert parts["ce"] == pytest.approx(entropy, rel=1e-4)  # CE against itself = the teacher's entropy
    assert float(loss.detach()) == pytest.approx(0.1 * entropy, rel=1e-4)
    _, sub = distillation_loss(ex.shallow, ex.deep, split, vocab_subset=torch.arange(10))
    assert sub["smooth_l1"] > 0


def test_training_improves_agreement_and_round_trips(tiny: LlamaForCausalLM, tmp_path) -> None:
    torch.manual_seed(1)
    model = LlamaForCausalLM(tiny.config).eval()
    model.load_state_dict(tiny.state_dict())
    split = split_model(model, 2)
    data = [teacher_example(split, torch.randint(0, 96, (24,)).tolist()) for _ in range(4)]
    adapter = Adapter(model, m=2)
    before_llm = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = AdapterTrainer(split, adapter, TrainConfig(steps=60, lr=3e-3, lr_min=3e-4, vocab_subset_size=48))
    first = trainer.step(data)
    for _ in range(59):
        last = trainer.step(data)
    # The CE term has a floor (the teacher's own entropy); the feature-matching term must fall a lot.
    assert last["smooth_l1"] < 0.5 * first["smooth_l1"] and last["loss"] < first["loss"]
    assert trainer.lr_at(0) == pytest.approx(3e-3) and trainer.lr_at(60) == pytest.approx(3e-4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before_llm.items())  # the LLM is untouched
    untrained = AdapterTrainer(split, Adapter(model, m=2)).evaluate(data)["top1_agreement"]
    trained = trainer.evaluate(data)["top1_agreement"]
    assert trained > untrained, (trained, untrained)

    path = tmp_path / "adapter.safetensors"
    adapter.save(path, extra={"config": trainer.config_json()})
    loaded = Adapter.load(model, path)
    with torch.inference_mode():
        assert torch.equal(loaded(data[0].shallow), adapter(data[0].shallow))
    assert path.read_bytes()[:8] != b"\x80\x04\x95"[:8]  # safetensors header, not a pickle
