"""The inversions a curious HAT worker can fit (`tandem bench privacy`): hidden states back to input tokens.

nearest: the nearest row of the input embedding matrix (cosine), no training; linear: ridge regression hidden ->
input embedding, then the nearest row; inverter: the ridge probe plus a small MLP correction over the states of
positions t-1, t, t+1, trained with a sampled softmax over cosine similarity (the target, its nearest embedding rows
as hard negatives, random tokens). Pure torch on tensors: app/tools/bench/privacy_bench.py brings the text, the
model and the worker.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

# --- attack math ------------------------------------------------------------------------------------


def recovery_rate(predicted: torch.Tensor, actual: torch.Tensor) -> float:
    """Share of positions whose predicted token id equals the actual one."""
    if predicted.shape != actual.shape:
        raise ValueError(f"shapes differ: {tuple(predicted.shape)} vs {tuple(actual.shape)}")
    return float((predicted == actual).float().mean()) if actual.numel() else float("nan")


def unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def nearest_rows(queries: torch.Tensor, table: torch.Tensor, chunk: int = 256, shortlist: int = 8) -> torch.Tensor:
    """Index of each query's most cosine-similar row of `table` ([vocab, dim]).

    Scores in bfloat16 to shortlist candidates (twice as fast on a CPU), then re-ranks the shortlist in float32:
    the answer is the float32 argmax unless the true best row falls outside a bfloat16 top-`shortlist`."""
    table_u = unit_rows(table.float())
    table_b = table_u.to(torch.bfloat16)
    out = torch.empty(queries.shape[0], dtype=torch.long)
    with torch.inference_mode():
        for i in range(0, queries.shape[0], chunk):
            q = unit_rows(queries[i : i + chunk].float())
            k = min(shortlist, table.shape[0])
            cand = (q.to(torch.bfloat16) @ table_b.T).topk(k, dim=-1).indices  # [n, k]
            exact = torch.einsum("nd,nkd->nk", q, table_u[cand])
            out[i : i + chunk] = cand.gather(1, exact.argmax(dim=-1, keepdim=True)).squeeze(1)
    return out


@dataclass
class LinearProbe:
    """Ridge regression from standardised features to targets: y = ((x - mean) / std) @ weight + bias."""

    mean: torch.Tensor
    std: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def fit(cls, x: torch.Tensor, y: torch.Tensor, alpha: float = 1e-3) -> LinearProbe:
        """Least squares with an L2 penalty of alpha x n on the standardised features (alpha=0: plain least squares)."""
        x, y = x.double(), y.double()
        mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
        z = (x - mean) / std
        ymean = y.mean(0)
        gram = z.T @ z
        gram.diagonal().add_(alpha * x.shape[0])
        weight = torch.linalg.solve(gram, z.T @ (y - ymean))
        return cls(mean.float(), std.float(), weight.float(), ymean.float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.float() - self.mean) / self.std) @ self.weight + self.bias


def windows(states: torch.Tensor) -> torch.Tensor:
    """[seqs, len, dim] -> [seqs, len, 3 dim]: each position's state with its neighbours' (zeros past the ends)."""
    pad = torch.zeros_like(states[:, :1])
    prev = torch.cat([pad, states[:, :-1]], dim=1)
    nxt = torch.cat([states[:, 1:], pad], dim=1)
    return torch.cat([prev, states, nxt], dim=-1)


class Inverter(nn.Module):
    """Hidden states of positions t-1, t, t+1 -> a vector in embedding space, decoded by the nearest row.

    out = probe(x_t) + mlp([z_t-1, z_t, z_t+1]) on standardised states z: the ridge probe stays fixed and the
    MLP's last layer starts at zero, so training starts from the linear attack and learns a correction."""

    def __init__(self, probe: LinearProbe, width: int = 1024) -> None:
        super().__init__()
        dim, out = probe.weight.shape
        self.probe = probe
        self.mlp = nn.Sequential(nn.Linear(3 * dim, width), nn.GELU(), nn.Linear(width, out))
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)
        self.log_scale = nn.Parameter(torch.tensor(math.log(20.0)))

    def features(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """states [seqs, len, dim] (raw) -> (the probe's outputs, standardised windows), flattened over positions."""
        dim = states.shape[-1]
        z = (states.float() - self.probe.mean) / self.probe.std
        return self.probe(states).reshape(-1, self.probe.weight.shape[1]), windows(z).reshape(-1, 3 * dim)

    def head(self, linear: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        return linear + self.mlp(window)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """states [seqs, len, dim] (raw) -> [seqs * len, out]."""
        return self.head(*self.features(states))


def embedding_neighbours(embeddings: torch.Tensor, ids: torch.Tensor, k: int = 16) -> torch.Tensor:
    """[len(ids), k]: each token's k most cosine-similar other rows of the embedding matrix (the tokens that
    nearest-row decoding confuses it with), over the whole vocabulary."""
    table_u = unit_rows(embeddings.float())
    table_b = table_u.to(torch.bfloat16)
    out = []
    with torch.inference_mode():
        for i in range(0, ids.numel(), 512):
            q = table_b[ids[i : i + 512]]
            out.append((q @ table_b.T).topk(k + 1, dim=-1).indices[:, 1:])
    return torch.cat(out) if out else torch.empty(0, k, dtype=torch.long)


def train_inverter(
    states: torch.Tensor,
    ids: torch.Tensor,
    embeddings: torch.Tensor,
    probe: LinearProbe,
    seconds: float,
    *,
    max_steps: int = 100_000,
    batch: int = 512,
    negatives: int = 1024,
    neighbours: int = 8,
    lr: float = 3e-4,
    seed: int = 0,
    near: torch.Tensor | None = None,
) -> tuple[Inverter, dict[str, float]]:
    """Fit an Inverter on states [seqs, len, dim] with token ids [seqs, len] for `seconds` of wall time.

    Loss: cross-entropy of scale x cosine(out, embedding) over a sampled softmax — the batch's tokens, each one's
    `neighbours` nearest embedding rows in the whole vocabulary (the hard negatives of nearest-row decoding) and
    `negatives` random tokens of the fitting text's vocabulary. `near`: embedding_neighbours(embeddings,
    unique(ids), neighbours) when already computed (it does not depend on the states)."""
    gen = torch.Generator().manual_seed(seed)
    model = Inverter(probe)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    flat_ids = ids.reshape(-1)
    vocab = torch.unique(flat_ids)
    if near is None:
        near = embedding_neighbours(embeddings, vocab, neighbours)  # row i: vocab[i]'s neighbours
    table = unit_rows(embeddings.float())
    with torch.inference_mode():
        linear, window = model.features(states)
    linear, window = linear.clone(), window.clone()
    t0, steps, loss_v = time.perf_counter(), 0, float("nan")
    while steps < max_steps and (steps == 0 or time.perf_counter() - t0 < seconds):
        rows = torch.randint(0, flat_ids.numel(), (batch,), generator=gen)
        target_ids = flat_ids[rows]
        hard = near[torch.searchsorted(vocab, target_ids)].reshape(-1)
        extra = vocab[torch.randint(0, vocab.numel(), (negatives,), generator=gen)]
        cand = torch.unique(torch.cat([target_ids, hard, extra]))
        target = torch.searchsorted(cand, target_ids)
        out = unit_rows(model.head(linear[rows], window[rows]))
        logits = model.log_scale.exp() * out @ table[cand].T
        loss = nn.functional.cross_entropy(logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        steps += 1
        loss_v = float(loss.detach())
    model.eval()
    return model, {"steps": steps, "seconds": round(time.perf_counter() - t0, 1), "final_loss": round(loss_v, 3)}
