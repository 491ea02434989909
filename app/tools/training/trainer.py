"""The adapter's training loop: HAT's distillation loss, AdamW with warm-up and cosine, exact checkpoints.

The adapter (clients.hat.adapter.Adapter) is trained so its output features match the LLM's deep features at the
same positions (HAT Eq. 4):

    Loss = SmoothL1(f_L, f_S) + w_ce * CE(softmax(H(f_L)), H(f_S)),   w_ce = 0.1

Features are compared after the final norm (what the LM head actually reads; raw deep states of Qwen carry huge
outlier dimensions that would dominate a SmoothL1 on unnormalised values). The CE is a soft cross-entropy against
the LLM's own distribution, on a vocabulary subset for speed: the corpus' most frequent tokens, the batch's own
next tokens and a random slice. Batches are right-padded whole sequences. Checkpoints (adapter + AdamW moments as
safetensors, scalars as JSON; never pickle) resume to the batches and vocabulary slices of the uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from app.tools import import_extra
from app.tools.training.features import Features
from app.tools.training.report import top1_agreement


def distillation_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    split: Any,
    w_ce: float = 0.1,
    vocab_subset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """HAT Eq. 4 on features [.., hidden]: SmoothL1 on normed features + w_ce * soft CE through the LM head."""
    norm, head = split.output.norm, split.output.lm_head
    weight = head.weight if vocab_subset is None else head.weight[vocab_subset]
    bias = getattr(head, "bias", None)
    if bias is not None and vocab_subset is not None:
        bias = bias[vocab_subset]
    with torch.no_grad():
        ft = norm(teacher)
        p_teacher = F.softmax(F.linear(ft, weight, bias).float(), dim=-1)
    fs = norm(student)
    sl = F.smooth_l1_loss(fs, ft)
    log_p_student = F.log_softmax(F.linear(fs, weight, bias).float(), dim=-1)
    ce = -(p_teacher * log_p_student).sum(-1).mean()
    loss = sl + w_ce * ce
    return loss, {"loss": float(loss.detach()), "smooth_l1": float(sl.detach()), "ce": float(ce.detach())}


@dataclass
class TrainOptions:
    steps: int = 1000
    batch: int = 8
    lr: float = 1e-3
    lr_min: float = 1e-4
    warmup: int = 10
    weight_decay: float = 0.0
    w_ce: float = 0.1
    ce_vocab: int = 4096  # CE vocabulary subset size (frequent tokens + the batch's next tokens + a random slice)
    max_grad_norm: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50
    eval_every: int = 200
    eval_sequences: int = 8
    time_budget_s: float | None = None  # stop training after this many seconds (this invocation)
    # Loss on answer positions only (each sequence from its prompt's last token): drafts are made while answering,
    # and long code-reading prompts would otherwise outweigh every answer in the corpus.
    answers_only: bool = False


def lr_at(step: int, total: int, opts: TrainOptions) -> float:
    """Linear warm-up, then cosine from lr to lr_min over the remaining steps."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    t = min((step - opts.warmup) / max(1, total - opts.warmup), 1.0)
    return opts.lr_min + 0.5 * (opts.lr - opts.lr_min) * (1 + math.cos(math.pi * t))


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """Which training sequences step `step` uses: consecutive slices of a fresh seeded permutation per epoch.

    A pure function of (step, batch, n, seed), so a resumed run sees the batches the uninterrupted run would.
    """
    out = []
    perms: dict[int, list[int]] = {}
    for j in range(step * batch, (step + 1) * batch):
        epoch, k = divmod(j, n)
        if epoch not in perms:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perms[epoch] = torch.randperm(n, generator=g).tolist()
        out.append(perms[epoch][k])
    return out


class Trainer:
    """AdamW + cosine on the adapter alone, with safetensors/JSON checkpoints that resume exactly."""

    def __init__(
        self,
        split: Any,
        adapter: Any,
        train: Sequence[Features],
        opts: TrainOptions,
        loss_from: int = 0,
        frequent: Sequence[int] = (),
        held_out: Sequence[Features] = (),
    ) -> None:
        if not train:
            raise ValueError("no training sequences")
        self.split, self.adapter, self.train, self.opts = split, adapter, list(train), opts
        self.loss_from = loss_from
        self.frequent = torch.tensor(sorted(set(frequent))[: max(0, opts.ce_vocab)], dtype=torch.long)
        self.held_out = list(held_out)
        for module in (split.input, split.middle, split.output):
            for p in module.parameters():
                p.requires_grad_(False)
        self.params = dict(adapter.block.named_parameters())
        for p in self.params.values():
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=opts.lr, weight_decay=opts.weight_decay)
        self.step = 0
        self.total_steps = opts.steps
        self.train_seconds = 0.0
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []

    # -- one step ----------------------------------------------------------------------------------

    def vocab_subset(self, step: int, batch: Sequence[Features]) -> torch.Tensor | None:
        vocab = self.split.vocab_size
        size = self.opts.ce_vocab
        if size <= 0 or size >= vocab:
            return None
        nxt = torch.cat([f.ids[1:] for f in batch])
        base = torch.cat([self.frequent[: size // 2], nxt]).unique()
        g = torch.Generator().manual_seed(self.opts.seed * 7_919 + step)
        rand = torch.randperm(vocab, generator=g)[: max(0, size - base.numel())]
        return torch.cat([base, rand]).unique()

    def batch(self, step: int) -> list[Features]:
        return [self.train[i] for i in batch_indices(step, self.opts.batch, len(self.train), self.opts.seed)]

    def run_step(self) -> dict[str, float]:
        step = self.step
        lr = lr_at(step, self.total_steps, self.opts)
        for group in self.opt.param_groups:
            group["lr"] = lr
        batch = self.batch(step)
        subset = self.vocab_subset(step, batch)
        longest = max(f.shallow.shape[0] for f in batch)
        hidden = batch[0].shallow.shape[1]
        shallow = torch.zeros(len(batch), longest, hidden)
        deep = torch.zeros(len(batch), longest, hidden)
        mask = torch.zeros(len(batch), longest, dtype=torch.bool)
        for r, f in enumerate(batch):
            n = f.shallow.shape[0]
            shallow[r, :n], deep[r, :n] = f.shallow, f.deep
            start = f.prompt_len - 1 if self.opts.answers_only else self.loss_from
            mask[r, min(start, n - 1) : n] = True  # right padding: no real token attends to it
        self.adapter.train()
        self.opt.zero_grad(set_to_none=True)
        feats = self.adapter(shallow)
        loss, parts = distillation_loss(feats[mask], deep[mask], self.split, self.opts.w_ce, subset)
        loss.backward()
        if self.opts.max_grad_norm > 0:
            parts["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params.values(), self.opts.max_grad_norm))
        self.opt.step()
        self.step += 1
        parts.update(step=self.step, lr=lr, tokens=int(mask.sum()))
        self.history.append({k: round(float(v), 5) for k, v in parts.items()})
        return parts

    # -- evaluation ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def evaluate(self, sequences: Sequence[Features] | None = None) -> dict[str, float]:
        seqs = list(sequences if sequences is not None else self.held_out[: self.opts.eval_sequences])
        if not seqs:
            return {}
        self.adapter.eval()
        stats = top1_agreement(self.split, lambda s: self.adapter(s), seqs)
        stats["step"] = self.step
        return stats

    # -- checkpoints (safetensors + JSON; no pickle) -----------------------------------------------------

    def save_checkpoint(self, folder: Path, extra: dict[str, Any] | None = None) -> None:
        from safetensors.torch import save_file

        tmp = folder.with_name(folder.name + ".tmp")
        old = folder.with_name(folder.name + ".old")
        if tmp.exists():
            _rmtree(tmp)
        tmp.mkdir(parents=True)
        self.adapter.save(tmp / "adapter.safetensors")
        moments: dict[str, torch.Tensor] = {}
        adam_steps: dict[str, float] = {}
        for name, p in self.params.items():
            st = self.opt.state.get(p)
            if st:
                moments[f"{name}.exp_avg"] = st["exp_avg"].detach().contiguous()
                moments[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().contiguous()
                adam_steps[name] = float(st["step"])
        save_file(moments, str(tmp / "optimizer.safetensors"))
        state = {
            "step": self.step,
            "total_steps": self.total_steps,
            "train_seconds": round(self.train_seconds, 3),
            "adam_steps": adam_steps,
            "options": asdict(self.opts),
            "history": self.history,
            "evals": self.evals,
            **(extra or {}),
        }
        (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
        if folder.exists():
            if old.exists():
                _rmtree(old)
            os.replace(folder, old)
        os.replace(tmp, folder)
        if old.exists():
            _rmtree(old)

    def load_checkpoint(self, folder: Path) -> dict[str, Any]:
        from safetensors.torch import load_file

        state = json.loads((folder / "state.json").read_text())
        weights = load_file(str(folder / "adapter.safetensors"))
        self.adapter.block.load_state_dict(weights)
        moments = load_file(str(folder / "optimizer.safetensors"))
        for name, p in self.params.items():
            if name in state["adam_steps"]:
                self.opt.state[p] = {
                    "step": torch.tensor(state["adam_steps"][name], dtype=torch.float32),
                    "exp_avg": moments[f"{name}.exp_avg"].clone(),
                    "exp_avg_sq": moments[f"{name}.exp_avg_sq"].clone(),
                }
        self.step = int(state["step"])
        self.total_steps = int(state["total_steps"])
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.history = list(state.get("history", []))
        self.evals = list(state.get("evals", []))
        return state

    # -- the loop -----------------------------------------------------------------------------------------

    def fit(self, checkpoint_dir: Path | None, progress: bool = True, fresh: bool = True) -> str:
        """Train until total_steps or the time budget; returns why it stopped ("steps" | "time budget")."""
        tqdm = import_extra("tqdm").tqdm
        opts = self.opts
        start = time.monotonic()
        timed: list[float] = []
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not progress,
            dynamic_ncols=True,
        )
        reason = "steps"
        try:
            while self.step < self.total_steps:
                t0 = time.monotonic()
                parts = self.run_step()
                dt = time.monotonic() - t0
                self.train_seconds += dt
                timed.append(dt)
                bar.update(1)
                bar.set_postfix(loss=f"{parts['loss']:.4f}", ce=f"{parts['ce']:.3f}", lr=f"{parts['lr']:.1e}")
                elapsed = time.monotonic() - start
                if fresh and opts.time_budget_s and len(timed) == 6:
                    # Fit the cosine schedule into the budget once the step time is known (first step excluded).
                    per = sum(timed[1:]) / 5
                    overhead = 1.15  # evaluations and checkpoints
                    fit = self.step + int(max(0.0, opts.time_budget_s - elapsed) / (per * overhead))
                    if fit < self.total_steps:
                        self.total_steps = max(fit, self.step + 1)
                        bar.total = self.total_steps
                        bar.write(f"time budget: schedule shortened to {self.total_steps} steps ({per:.2f} s/step)")
                if opts.eval_every and self.step % opts.eval_every == 0 and self.held_out:
                    ev = self.evaluate()
                    self.evals.append(ev)
                    bar.write(f"step {self.step}: held-out top-1 {ev['top1_response']:.3f} (response positions)")
                if checkpoint_dir is not None and opts.checkpoint_every and self.step % opts.checkpoint_every == 0:
                    self.save_checkpoint(checkpoint_dir)
                if opts.time_budget_s and time.monotonic() - start >= opts.time_budget_s:
                    reason = "time budget"
                    break
        finally:
            bar.close()
            if checkpoint_dir is not None:
                self.save_checkpoint(checkpoint_dir)
        return reason


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
