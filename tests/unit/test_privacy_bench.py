"""The attack math of `tandem bench privacy` and the HAT noise defence, on synthetic data and a tiny random model."""

from __future__ import annotations

import pytest
import torch

from app.config import HATCloudSettings
from app.tools.bench.inversion import LinearProbe, nearest_rows, recovery_rate, train_inverter, windows
from app.tools.bench.privacy_bench import AttackData, agreement, run_attacks, sequences, shallow_states
from clients.hat.noise import add_noise, noise_generator
from clients.hat.split import InputSubmodel


def test_recovery_rate_counts_exact_matches() -> None:
    assert recovery_rate(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 0, 3, 0])) == 0.5
    assert recovery_rate(torch.tensor([[5, 5], [5, 5]]), torch.tensor([[5, 5], [5, 6]])) == 0.75
    with pytest.raises(ValueError):
        recovery_rate(torch.tensor([1, 2]), torch.tensor([1, 2, 3]))


def test_nearest_rows_is_the_cosine_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(3000, 24, generator=gen)
    queries = torch.randn(300, 24, generator=gen)
    unit = table.double() / table.double().norm(dim=-1, keepdim=True)
    cosine = (queries.double() / queries.double().norm(dim=-1, keepdim=True)) @ unit.T  # exact, in float64
    got = nearest_rows(queries, table, chunk=64)
    # The float32 argmax: the chosen row is the best up to float32's rounding (two rows within it are a tie whose
    # winner depends on the kernels' summation order, so it is not compared across computation paths).
    chosen = cosine.gather(1, got[:, None]).squeeze(1)
    assert torch.all(cosine.max(dim=-1).values - chosen <= 1e-6)
    assert (got == cosine.argmax(dim=-1)).float().mean() >= 0.98
    ids = torch.randint(0, 3000, (100,), generator=gen)
    scaled = 7.0 * table[ids] + 0.01 * torch.randn(100, 24, generator=gen)  # cosine ignores scale
    assert recovery_rate(nearest_rows(scaled, table), ids) == 1.0


def test_linear_probe_recovers_an_exactly_linear_map() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2000, 16, generator=gen) * torch.linspace(0.1, 30, 16) + 5  # uneven scales: standardised
    a, b = torch.randn(16, 8, generator=gen), torch.randn(8, generator=gen)
    y = x @ a + b
    probe = LinearProbe.fit(x, y, alpha=0.0)
    assert torch.allclose(probe(x), y, atol=1e-3)
    held = torch.randn(50, 16, generator=gen)
    assert torch.allclose(probe(held), held @ a + b, atol=1e-3)
    ridge = LinearProbe.fit(x, y, alpha=10.0)  # a strong penalty shrinks towards the mean
    assert float((ridge(x) - y).abs().mean()) > float((probe(x) - y).abs().mean())


def _linear_states(seed: int = 2, vocab: int = 400, dim: int = 32, seqs: int = 40, length: int = 16):
    """Token ids and 'hidden states' that are an invertible linear mix of their embeddings plus a large offset
    (nearest-embedding fails on them; a linear probe should not)."""
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, dim, generator=gen)
    mix = torch.randn(dim, dim, generator=gen)
    ids = torch.randint(0, vocab, (seqs, length), generator=gen)
    states = emb[ids] @ mix + 3.0
    return emb, ids, states


def test_a_linear_probe_beats_nearest_embedding_on_mixed_states() -> None:
    emb, ids, states = _linear_states()
    fit, held = slice(0, 30), slice(30, 40)
    data = AttackData(states[fit], ids[fit], states[held], ids[held], torch.zeros(10, dtype=torch.long))
    out = run_attacks(data, emb, alpha=0.0, inverter_seconds=0)
    assert out["linear"]["all"] == 1.0 and out["linear"]["fit_on"] == "clean"
    assert out["nearest"]["all"] < 0.2
    assert out["linear"]["code"] == 1.0 and "prose" not in out["linear"] and "inverter" not in out


def test_attacker_fitting_on_noised_states_is_tried_and_named() -> None:
    emb, ids, states = _linear_states(seed=3)
    noisy = add_noise(states, 0.8, noise_generator(0))
    data = AttackData(states[:30], ids[:30], noisy[30:], ids[30:], torch.ones(10, dtype=torch.long))
    attacker = {"noised": add_noise(states[:30], 0.8, noise_generator(1))}
    out = run_attacks(data, emb, alpha=1e-3, inverter_seconds=0, attacker_states=attacker)
    assert out["linear"]["fit_on"] in ("clean", "noised") and 0 <= out["linear"]["prose"] <= 1


def test_inverter_starts_from_the_probe_and_trains() -> None:
    emb, ids, states = _linear_states(seed=4)
    probe = LinearProbe.fit(states.reshape(-1, 32), emb[ids.reshape(-1)], alpha=0.0)
    inv, info = train_inverter(states, ids, emb, probe, seconds=0.0, max_steps=3, negatives=64)
    assert info["steps"] >= 1
    with torch.inference_mode():
        pred = inv(states).reshape(-1, 32)
    assert recovery_rate(nearest_rows(pred, emb), ids.reshape(-1)) > 0.95


def test_windows_pads_with_zeros() -> None:
    s = torch.arange(12.0).reshape(1, 3, 4)
    w = windows(s)
    assert w.shape == (1, 3, 12)
    assert torch.equal(w[0, 0, :4], torch.zeros(4)) and torch.equal(w[0, 2, 8:], torch.zeros(4))
    assert torch.equal(w[0, 1], torch.cat([s[0, 0], s[0, 1], s[0, 2]]))


def test_shallow_states_are_the_input_submodels_output(tiny) -> None:
    ids = torch.randint(0, 96, (3, 10), generator=torch.Generator().manual_seed(5))
    got = shallow_states(tiny, ids, [1, 3], batch=3)  # one batch: the same matmuls, so bit for bit
    with torch.inference_mode():
        for m in (1, 3):
            assert got[m].shape == (3, 10, 32)
            assert torch.equal(got[m], InputSubmodel(tiny, m)(ids))
        batched = shallow_states(tiny, ids, [3], batch=2)[3]  # other batch sizes: up to float reassociation
        assert torch.allclose(batched, InputSubmodel(tiny, 3)(ids), atol=1e-6)
    half = shallow_states(tiny, ids, [2], batch=3, wire_dtype=torch.float16)[2]
    with torch.inference_mode():
        assert torch.equal(half, InputSubmodel(tiny, 2)(ids).to(torch.float16).float())


def test_sequences_cut_windows_round_robin() -> None:
    class Tok:
        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            return {"input_ids": [ord(c) for c in text]}

    seqs = sequences(Tok(), ["a" * 10, "b" * 10], tokens=12, seq_len=4)
    assert seqs.shape == (3, 4)
    assert [chr(int(r[0])) for r in seqs] == ["a", "b", "a"]


def test_agreement_counts_identical_outputs_and_prefixes() -> None:
    out = agreement([[1, 2, 3, 4], [1, 9, 9, 9]], [[1, 2, 3, 4], [1, 2, 3, 4]])
    assert out == {"identical": 0.5, "prefix_agreement": (1.0 + 0.25) / 2}


def test_noise_is_relative_seeded_and_absent_at_zero() -> None:
    h = torch.randn(64, 512) * torch.linspace(0.1, 10, 64)[:, None]
    assert add_noise(h, 0.0) is h
    a = add_noise(h, 0.2, noise_generator(7))
    assert torch.equal(a, add_noise(h, 0.2, noise_generator(7)))
    assert not torch.equal(a, add_noise(h, 0.2, noise_generator(8)))
    assert not torch.equal(add_noise(h, 0.2), add_noise(h, 0.2))  # unseeded: fresh per generator
    rel = (a - h).pow(2).mean(-1).sqrt() / h.pow(2).mean(-1).sqrt()
    assert torch.allclose(rel, torch.full_like(rel, 0.2), rtol=0.15)
    assert add_noise(h.half(), 0.1, noise_generator(0)).dtype == torch.float16
    with pytest.raises(ValueError):
        add_noise(h, -0.1)


def test_hat_cloud_noise_setting() -> None:
    assert HATCloudSettings(kind="hat").noise == 0.0
    assert HATCloudSettings(kind="hat", noise=0.05).noise == 0.05
    with pytest.raises(ValueError):
        HATCloudSettings(kind="hat", noise=-1)


def test_gateway_passes_a_hat_clouds_noise_to_its_backend(monkeypatch) -> None:
    from types import SimpleNamespace

    import app.serving.gateway as gw

    monkeypatch.setattr(gw, "resolve_model", lambda name: f"/models/{name}.gguf")
    fake = SimpleNamespace(embedded=[])
    for noise in (0.0, 0.25):
        cloud = HATCloudSettings(kind="hat", noise=noise)
        backend = gw.Gateway._hat_backend(fake, "hat", cloud)
        assert backend.options.noise == noise and backend.link_options.noise == noise
        assert backend.link_options.noise_seed is None  # a fresh seed per session in the gateway


def test_the_held_out_text_is_pinned_not_read_from_the_repository(tmp_path, monkeypatch) -> None:
    """The held-out text is the shipped snapshot (commit 717abd1's code and README / ARCHITECTURE): editing, or even
    removing, the repository's files does not change it, and a changed snapshot is refused."""
    import app.tools.bench.privacy_bench as bench

    pinned = bench.held_out_texts()
    monkeypatch.setattr(bench, "REPO_ROOT", tmp_path)  # a repository without any file
    assert bench.held_out_texts() == pinned
    assert len(pinned["prose"]) == 2 and len(pinned["code"]) >= 10
    assert sum(map(len, pinned["prose"])) > 30_000 and sum(map(len, pinned["code"])) > 100_000
    assert pinned["prose"][0].startswith("# Tandem") and "def " in pinned["code"][1]
    readme = (bench.HELD_OUT.parents[1] / "README.md").read_text()
    assert pinned["prose"][0] != readme  # today's README is not the held-out text
    changed = tmp_path / "held_out.json.gz"
    data = bytearray(bench.HELD_OUT.read_bytes())
    data[-9] ^= 1
    changed.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        bench.held_out_texts(changed)
