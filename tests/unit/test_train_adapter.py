"""`tandem train-adapter` (app/tools/training/) on tiny data: SmolLM2-135M, a handful of prompts, a few steps; the loss
and the trainer's learning also on a tiny random Llama (no weights needed)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from app.tools.training import train_adapter as ta
from app.tools.training.code_prompts import is_code_index
from app.tools.training.corpus import (
    DEFAULT_PROMPTS,
    CorpusConfig,
    Example,
    chat_ids,
    frequent_tokens,
    generate_corpus,
    is_held_out,
    load_prompts,
    load_tokenizer,
    read_corpus,
)
from app.tools.training.features import Features, compute_features, load_features
from app.tools.training.report import accept_length, simulate_rounds, top1_agreement
from app.tools.training.trainer import Trainer, TrainOptions, batch_indices, distillation_loss, lr_at
from clients.hat.adapter import Adapter, draft_files, shipped_adapter_path
from clients.hat.split import split_model
from deploy.models import model_path
from policies.drafting import DraftStopRule

SMOL = "smollm2-135m-instruct"
PROMPTS = [
    "Write a Python function that adds two numbers.",
    "What is a list in Python?",
    "Say hello.",
    "Write a SQL query that counts rows.",
    "What is 2 + 2?",
    "Name a prime number.",
    "Write a Bash loop from 1 to 3.",
    "What is a tuple?",  # index 7: held out
]


def _need(name: str) -> Path:
    path = model_path(name)
    if not path.exists():
        pytest.skip(f"{name} is not fetched (python -m deploy.models fetch {name})")
    return path


@pytest.fixture(scope="module")
def smol():
    """SmolLM2 (fp32, HF) split after 2 layers, with its tokenizer."""
    torch.set_num_threads(1)
    model, tokenizer, split = ta._load_split(_need(SMOL), 2)
    return model, tokenizer, split


def _examples(tokenizer, n: int = 3, new: int = 10) -> list[Example]:
    out = []
    for i, p in enumerate(PROMPTS[:n]):
        ids = chat_ids(tokenizer, p)
        resp = tokenizer(f" Answer number {i}: it is fine.", add_special_tokens=False)["input_ids"][:new]
        out.append(Example(i, is_held_out(i), ids, resp, key=f"k{i}"))
    return out


def test_prompt_file_and_held_out_rule() -> None:
    prompts = load_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 200
    assert len(set(prompts)) == len(prompts)
    held = [i for i in range(len(prompts)) if is_held_out(i)]
    assert held[:3] == [7, 15, 23] and len(held) == len(prompts) // 8
    assert any("\n" in p for p in prompts)  # "\n" escapes become newlines


def test_corpus_resume_skips_done_prompts(tmp_path: Path) -> None:
    gguf = _need(SMOL)
    tok = load_tokenizer(gguf)
    cfg = CorpusConfig(max_new_tokens=4, threads=1, n_ctx=512)
    out = tmp_path / "corpus.jsonl"
    first = generate_corpus(PROMPTS, out, gguf, tok, cfg, indices=range(3), progress=False)
    assert sorted(first) == [0, 1, 2]
    with open(out, "a") as f:
        f.write('{"index": 5, "held_out": fal')  # a record torn by a crash: regenerated
    full = generate_corpus(PROMPTS, out, gguf, tok, cfg, progress=False)
    assert sorted(full) == list(range(8))
    lines = out.read_text().splitlines()
    assert len(lines) == 3 + 1 + 5  # the three done prompts were not generated again
    for i in range(3):
        assert full[i] == first[i]
    ex = full[7]
    assert ex.held_out and ex.temperature == 0.0 and full[0].temperature == cfg.temperature
    assert 1 <= len(ex.response_ids) <= 4 and ex.prompt_ids == chat_ids(tok, PROMPTS[7])
    # Everything done: no model is even loaded.
    again = generate_corpus(PROMPTS, out, Path("/nonexistent.gguf"), tok, cfg, progress=False)
    assert sorted(again) == list(range(8)) and len(out.read_text().splitlines()) == 9
    # Other settings make other records: the prompt is answered again.
    other = generate_corpus(PROMPTS, out, gguf, tok, CorpusConfig(max_new_tokens=3), indices=[0], progress=False)
    assert other[0].key != first[0].key and len(other[0].response_ids) <= 3


def test_batches_are_a_pure_function_of_the_step() -> None:
    a = [batch_indices(s, 3, 7, seed=1) for s in range(10)]
    assert a == [batch_indices(s, 3, 7, seed=1) for s in range(10)]
    flat = [i for b in a for i in b]
    assert sorted(flat[:7]) == list(range(7))  # each epoch is a permutation
    assert lr_at(0, 100, TrainOptions(warmup=10)) == pytest.approx(1e-4)
    assert lr_at(100, 100, TrainOptions(warmup=10)) == pytest.approx(1e-4)


def _teacher(split, ids: list[int], index: int = 0) -> Features:
    """Teacher features of a bare token sequence (no prompt part), with the LLM's argmax."""
    return compute_features(split, Example(index, False, [], ids), 1024, with_top1=True)


def test_loss_is_eq4(tiny: LlamaForCausalLM) -> None:
    split = split_model(tiny, 2)
    ex = _teacher(split, torch.randint(0, 96, (10,)).tolist())
    loss, parts = distillation_loss(ex.deep, ex.deep, split, w_ce=0.1)
    assert parts["smooth_l1"] == 0.0
    with torch.no_grad():
        p = torch.softmax(split.output(ex.deep), -1)
    entropy = float(-(p * p.log()).sum(-1).mean())
    assert parts["ce"] == pytest.approx(entropy, rel=1e-4)  # CE against itself = the teacher's entropy
    assert float(loss.detach()) == pytest.approx(0.1 * entropy, rel=1e-4)
    _, sub = distillation_loss(ex.shallow, ex.deep, split, vocab_subset=torch.arange(10))
    assert sub["smooth_l1"] > 0


def test_answers_only_trains_on_each_answer_not_its_prompt(tiny: LlamaForCausalLM) -> None:
    split = split_model(tiny, 2)
    data = []
    for i, prompt_len in enumerate((5, 12)):
        ids = torch.randint(0, 96, (20,)).tolist()
        data.append(compute_features(split, Example(i, False, ids[:prompt_len], ids[prompt_len:]), 1024, False))
    opts = TrainOptions(steps=1, batch=2, ce_vocab=48, eval_every=0, answers_only=True)
    # each sequence from its prompt's last position (which predicts the first answer token) to its end
    assert Trainer(split, Adapter(tiny, m=2), data, opts).run_step()["tokens"] == (20 - 4) + (20 - 11)
    every = TrainOptions(steps=1, batch=2, ce_vocab=48, eval_every=0)
    assert Trainer(split, Adapter(tiny, m=2), data, every, loss_from=2).run_step()["tokens"] == 2 * (20 - 2)


def test_training_improves_agreement_and_round_trips(tiny: LlamaForCausalLM, tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = LlamaForCausalLM(tiny.config).eval()
    model.load_state_dict(tiny.state_dict())
    split = split_model(model, 2)
    data = [_teacher(split, torch.randint(0, 96, (24,)).tolist(), i) for i in range(4)]
    adapter = Adapter(model, m=2)
    before_llm = {k: v.clone() for k, v in model.state_dict().items()}
    opts = TrainOptions(steps=60, batch=4, lr=3e-3, lr_min=3e-4, warmup=0, ce_vocab=48, eval_every=0)
    trainer = Trainer(split, adapter, data, opts)
    first = trainer.run_step()
    for _ in range(59):
        last = trainer.run_step()
    # The CE term has a floor (the teacher's own entropy); the feature-matching term must fall a lot.
    assert last["smooth_l1"] < 0.5 * first["smooth_l1"] and last["loss"] < first["loss"]
    assert lr_at(0, 60, opts) == pytest.approx(3e-3) and lr_at(60, 60, opts) == pytest.approx(3e-4)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before_llm.items())  # the LLM is untouched
    untrained = Trainer(split, Adapter(model, m=2), data, opts).evaluate(data)["top1_all"]
    trained = trainer.evaluate(data)["top1_all"]
    assert trained > untrained, (trained, untrained)

    path = tmp_path / "adapter.safetensors"
    adapter.save(path, extra={"options": json.dumps(asdict(opts))})
    loaded = Adapter.load(model, path)
    with torch.inference_mode():
        assert torch.equal(loaded(data[0].shallow), adapter(data[0].shallow))
    assert path.read_bytes()[:8] != b"\x80\x04\x95"[:8]  # safetensors header, not a pickle


def test_checkpoint_resume_continues_from_the_saved_step(smol, tmp_path: Path) -> None:
    model, tok, split = smol
    feats = load_features(split, _examples(tok), tmp_path / "features", SMOL, progress=False)
    assert (tmp_path / "features" / "00000.safetensors").exists()
    again = load_features(split, _examples(tok), tmp_path / "features", SMOL, progress=False)  # from the cache
    assert torch.equal(again[1].deep, feats[1].deep)
    opts = TrainOptions(steps=4, batch=2, lr=3e-3, warmup=1, ce_vocab=512, checkpoint_every=0, eval_every=0)
    freq = frequent_tokens([f.ids.tolist() for f in feats], 256)

    straight = Trainer(split, Adapter(model, 2), feats, opts, frequent=freq)
    straight.fit(None, progress=False)

    first = Trainer(split, Adapter(model, 2), feats, opts, frequent=freq)
    first.run_step()
    first.run_step()
    first.save_checkpoint(tmp_path / "ckpt")
    state = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    assert state["step"] == 2 and state["total_steps"] == 4

    resumed = Trainer(split, Adapter(model, 2), feats, opts, frequent=freq)
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 2
    resumed.fit(tmp_path / "ckpt", progress=False, fresh=False)
    assert resumed.step == 4 and len(resumed.history) == 4
    want, got = straight.adapter.block.state_dict(), resumed.adapter.block.state_dict()
    for name in want:
        assert torch.allclose(want[name], got[name], atol=1e-6), name
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["step"] == 4
    assert straight.history[-1]["loss"] == pytest.approx(resumed.history[-1]["loss"], rel=1e-5)


def test_simulated_rounds_on_known_cases() -> None:
    text = list(range(100, 130))  # 30 tokens; rounds start at position 5
    right = [*text[1:], 0]  # the LLM's prediction at q is text[q+1]
    sure = [0.99] * 30
    rule = DraftStopRule(eta=0.6, max_draft=8)
    perfect = simulate_rounds(text, right, right, sure, 5, rule)
    assert (perfect.rounds, perfect.tokens) == (3, 25)  # 8+1, 8+1, then the 6 tokens left + 1
    assert perfect.accepted_hist[8] == 2 and perfect.accepted_hist[6] == 1
    wrong = simulate_rounds(text, right, [1] * 30, sure, 5, rule)
    assert (wrong.rounds, wrong.tokens, wrong.accepted) == (24, 24, 0)  # one LLM token per round
    unsure = [0.3] * 30
    send = simulate_rounds(text, right, right, unsure, 5, rule)  # the low-confidence draft is sent (and right)
    assert send.summary()["accept_length"] == pytest.approx(2.0)
    before = simulate_rounds(text, right, right, unsure, 5, DraftStopRule(0.6, 8, include_low_confidence=False))
    assert before.summary()["accept_length"] == 1.0 and before.empty_rounds == before.rounds
    # Confidence drops at position 8: the round from 5 keeps drafts for 5, 6, 7 and the unsure one for 8.
    dip = simulate_rounds(text, right, right, [0.99] * 8 + [0.3] + [0.99] * 21, 5, rule)
    # Then from 10: 8 + 1, from 19: 8 + 1, and the 1 token left from 28 (no drafts: the text ends at 29).
    assert (dip.rounds, dip.tokens) == (4, 25) and dip.accepted_hist[4] == 1 and dip.accepted_hist[8] == 2
    # llama.cpp's text leaves the LLM's argmax at position 7: the round stops there after accepting it.
    tie = right.copy()
    tie[7] = 999
    cut = simulate_rounds(text, tie, tie, sure, 5, rule)
    assert cut.tie_breaks == 1 and cut.accepted_hist[3] == 1


def test_report_on_an_oracle_adapter(smol) -> None:
    """The middle submodel itself as the "adapter": the draft is the LLM, so every draft is accepted."""
    model, tok, split = smol
    prompt = chat_ids(tok, "Count from one to ten.")
    with torch.inference_mode():
        gen = model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False)[0].tolist()
    ex = Example(7, True, prompt, gen[len(prompt) :])
    f = compute_features(split, ex, 1024, with_top1=True)
    oracle = top1_agreement(split, split.middle, [f])
    assert oracle["top1_all"] == 1.0 and oracle["positions_response"] == len(ex.response_ids)
    rounds = accept_length(split, split.middle, [f], etas=(0.0,), max_draft=8)
    # eta = 0 keeps every draft: rounds of 8 accepted + 1 from the first response token (which prefill produced)
    # until the text runs out.
    known, p, expected = len(ex.response_ids) - 1, 0, 0
    while p < known:
        p += min(8, known - p) + 1
        expected += 1
    got = rounds["eta=0,send_low"]
    assert (got["rounds"], got["tokens"], got["tie_breaks"]) == (expected, p, 0)
    assert got["accepted_histogram"][8] == known // 9
    none = top1_agreement(split, lambda s: s, [f])
    assert none["top1_all"] < oracle["top1_all"]
    vocab = torch.tensor(sorted(set(f.ids.tolist()) | set(f.teacher_top1.tolist())))
    reduced = top1_agreement(split, split.middle, [f], vocab)  # the LLM's tokens are all in it
    assert reduced["top1_all"] == 1.0


def test_main_runs_every_stage_and_ships(tmp_path: Path) -> None:
    _need(SMOL)
    out, ship = tmp_path / "run", tmp_path / "ship" / "smol-m2.safetensors"
    base = ["--model", SMOL, "--out", str(out), "--limit", "8", "--max-new-tokens", "5", "--quiet"]
    train = ["--steps", "3", "--batch", "2", "--ce-vocab", "512", "--checkpoint-every", "2", "--eval-every", "2"]
    argv = [*base, *train, "--ship", str(ship), "--draft-vocab", "256", "--save-draft-vocab", "256"]
    assert ta.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["variants"]) == {"no_adapter", "untrained", "trained"}
    assert "eta=0.6,send_low" in report["variants"]["trained"]["rounds"]
    assert report["draft_vocab"]["256"]["timing"]["draft_step_ms"] > 0
    info = json.loads(ship.with_suffix(".json").read_text())
    assert info["command"].startswith("tandem train-adapter --model") and info["train"]["steps"] == 3
    # The shipped adapter's card carries the report's held-out numbers, not its own.
    rounds = report["variants"]["trained"]["rounds"][f"eta={report['eta']:g},send_low"]
    assert info["held_out"]["trained"]["accept_length_send_low"] == rounds["accept_length"] >= 1.0
    assert len(json.loads(ship.with_suffix(".draft-vocab.json").read_text())["token_ids"]) <= 256
    with pytest.raises(SystemExit):  # a checkpoint exists: training again needs --resume
        ta.main([*base, *train, "--stage", "train"])
    assert ta.main([*base, *train, "--stage", "train", "--resume", "--steps", "4"]) == 0
    assert json.loads((out / "train.json").read_text())["steps"] == 4

    # Code-reading prompts beside the chat ones, a warm start from the adapter just trained, a draft vocabulary that
    # keeps the earlier one's tokens, and the side-by-side report on held-out chat and code prompts.
    code = tmp_path / "code"
    first = tmp_path / "first.safetensors"
    first.write_bytes((out / "adapter.safetensors").read_bytes())
    earlier_vocab = ship.with_suffix(".draft-vocab.json")
    argv = [
        "--model", SMOL, "--out", str(code), "--limit", "8", "--max-new-tokens", "5", "--quiet", "--code-prompts", "8",
        "--code-max-tokens", "200", "--code-max-new-tokens", "4", *train, "--init-adapter", str(first),
        "--variants", "trained",
        "--save-draft-vocab", "64", "--draft-vocab-base", str(earlier_vocab), "--baseline", str(first),
        "--trained-vocab", str(code / "draft-vocab.json"),
    ]  # fmt: skip
    assert ta.main(argv) == 0
    corpus = read_corpus(code / "corpus.jsonl")
    assert sum(is_code_index(i) for i in corpus) == 8 and sum(not is_code_index(i) for i in corpus) == 8
    assert json.loads((code / "train.json").read_text())["init_adapter"] == str(first)
    vocab = set(json.loads((code / "draft-vocab.json").read_text())["token_ids"])
    assert set(json.loads(earlier_vocab.read_text())["token_ids"]) <= vocab
    sbs = json.loads((code / "report.json").read_text())["side_by_side"]
    assert set(sbs) == {"chat", "code"} and sbs["code"]["prompts"] == 1
    for group in sbs.values():
        assert group["baseline"]["vocab"] is None and group["trained"]["vocab"] == len(vocab)
        assert group["trained"]["accept_length_send_low"] >= 1.0 and 0 <= group["baseline"]["top1_response"] <= 1


def test_shipped_adapter_loads_for_qwen_0_5b() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = shipped_adapter_path(ta.DEFAULT_MODEL, ta.DEFAULT_M)
    assert path.exists(), f"the trained adapter is not shipped at {path}"
    # Qwen2.5-Coder-0.5B's attention shapes, in a 3-layer model (no weights needed to check the file fits).
    cfg = Qwen2Config(
        hidden_size=896,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=64,
        rms_norm_eps=1e-6,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    adapter = Adapter.load(model, path)
    assert adapter.m == 2
    p = adapter.block.self_attn.q_proj.weight
    assert p.dtype == torch.float32 and p.shape == (896, 896) and bool(torch.isfinite(p).all())
    assert adapter.block.self_attn.k_proj.weight.shape == (128, 896)
    info = json.loads(path.with_suffix(".json").read_text())
    # Shipped by issue 14's rule: it beats the adapter it replaced on held-out chat and code-reading answers.
    assert set(info["report"]["side_by_side"]) == {"chat", "code"}
    for held in info["report"]["side_by_side"].values():
        new, old = held["trained"], held["baseline"]
        assert new["top1_response"] > old["top1_response"]
        assert new["accept_length_send_low"] > old["accept_length_send_low"]
    assert info["command"].startswith("tandem train-adapter")


def test_draft_files_pair_the_shipped_vocabulary_with_the_shipped_adapter_only(tmp_path: Path) -> None:
    adapter, vocab = draft_files(ta.DEFAULT_MODEL, ta.DEFAULT_M)
    assert adapter == shipped_adapter_path(ta.DEFAULT_MODEL, ta.DEFAULT_M)
    assert vocab is not None and json.loads(vocab.read_text())["token_ids"]
    assert draft_files(ta.DEFAULT_MODEL, ta.DEFAULT_M, draft_vocab="full") == (adapter, None)
    mine = str(tmp_path / "mine.safetensors")
    assert draft_files(ta.DEFAULT_MODEL, ta.DEFAULT_M, adapter=mine) == (Path(mine), None)
    assert draft_files("no-such-model", 2) == (None, None)
