"""Token picking shared by the torch device backend and the HAT device half: greedy and nucleus sampling, and
speculative rejection sampling keeping the target distribution."""

from __future__ import annotations

import pytest
import torch

from clients.sampling import probabilities, sample_next, speculative_sample


def test_sample_next() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 4.9])
    assert sample_next(logits, 0.0, 1.0, None) == 1
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, 0.5, g) for _ in range(50)}
    assert draws <= {1, 3} and draws  # nucleus keeps only the top tokens
    flat = torch.tensor([1.0, 1.0, 1.1, 1.2, 0.9])
    draws = {sample_next(flat, 1.0, 1.0, g, top_k=2) for _ in range(60)}
    assert draws == {2, 3}  # top-k keeps the k likeliest, whatever their mass


def test_top_k_cuts_before_top_p() -> None:
    probs = probabilities(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), 1.0, top_p=1.0, top_k=2)
    assert probs[0, 2:].sum() == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    assert torch.equal(
        probabilities(torch.tensor([3.0, 2.0]), 1.0, top_k=5), probabilities(torch.tensor([3.0, 2.0]), 1.0)
    )


def test_speculative_sampling_preserves_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]])
    q = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    n = 20000
    first = torch.zeros(5)
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=gen))
        a, nxt = speculative_sample(p, [q], [d], gen)
        first[d if a == 1 else nxt] += 1
    assert float((first / n - p[0]).abs().sum()) < 0.03
    # top-p filtering keeps the top token and renormalises
    probs = probabilities(torch.tensor([3.0, 2.0, 0.0, -1.0]), 1.0, top_p=0.5)
    assert probs[0] == 1.0 and float(probs.sum()) == pytest.approx(1.0)


def test_min_p_keeps_only_tokens_at_least_that_share_of_the_likeliest() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = probabilities(logits, 1.0, min_p=0.25)  # keeps p >= 0.125: the first three
    assert probs[0, 3] == 0 and torch.allclose(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    # Judged before the temperature, as llama.cpp judges it: a hot sampler does not bring the cut tokens back.
    assert probabilities(logits, 2.0, min_p=0.25)[0, 3] == 0
    assert torch.equal(probabilities(logits, 1.0, min_p=0.0), probabilities(logits, 1.0))
