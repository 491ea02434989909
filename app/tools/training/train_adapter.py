"""`tandem train-adapter`: distil the HAT adapter (clients/hat/adapter.py) on text the LLM generates itself.

Stages (each resumable; `--stage all` runs them in order):

corpus  The LLM answers every prompt of deploy/adapter_prompts.txt (app.tools.training.corpus): training prompts
        sampled, held-out prompts (every 8th) greedily, appended to corpus.jsonl as they are done.
train   Teacher features of every sequence from the fp32 HF model split after layer m, cached in features/
        (app.tools.training.features); the adapter trained with HAT's Eq. 4 (app.tools.training.trainer). Checkpoints
        (checkpoint/) every N steps and at the end; `--resume` continues from one and reproduces the uninterrupted
        run's batches and vocab slices. `--time-budget` shrinks the schedule to what fits once the step time is
        known, and stops at the budget.
report  Held-out prompts: top-1 agreement and the accept length of simulated greedy HAT rounds for no adapter /
        the untrained adapter / the trained one, and optionally for reduced draft vocabularies (the K most frequent
        corpus tokens) (app.tools.training.report). Written to report.json.

`--ship` copies the trained adapter, in float16, where the device half finds it, with a JSON record of how it
was made and how it scores. Only safetensors and JSON are written or read here: never pickle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from app.tools.training.code_prompts import CODE_INDEX_BASE, build_code_prompts
from app.tools.training.corpus import (
    DEFAULT_PROMPTS,
    CorpusConfig,
    common_prefix_len,
    corpus_stats,
    frequent_tokens,
    generate_corpus,
    is_held_out,
    load_prompts,
    load_tokenizer,
    read_corpus,
    split_corpus,
)
from app.tools.training.features import load_features
from app.tools.training.report import (
    accept_length,
    predict,
    print_report,
    response_slice,
    side_by_side,
    time_draft_step,
    top1_agreement,
)
from app.tools.training.trainer import Trainer, TrainOptions

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
DEFAULT_M = 2


def _load_split(gguf: Path, m: int) -> tuple[Any, Any, Any]:
    from clients.hat.split import split_model
    from clients.hf_model import load_hf_model

    model, tokenizer = load_hf_model(gguf)
    model.eval()
    return model, tokenizer, split_model(model, m)


def _model_info(name: str, gguf: Path) -> dict[str, Any]:
    try:
        from deploy.models import MODELS

        sha = MODELS[name].sha256 if name in MODELS else None
    except Exception:  # pragma: no cover - deploy.models is part of the package
        sha = None
    return {"model": name, "gguf": gguf.name, "gguf_sha256": sha}


def save_fp16(src: str | os.PathLike[str], dest: str | os.PathLike[str], extra: dict[str, str] | None = None) -> None:
    """Rewrite an adapter file (Adapter.save) in float16: half the bytes; Adapter.load copies the weights into the
    model's float32 parameters. The metadata (m, init_from, ...) is kept."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(os.fspath(src), "pt") as f:
        meta = dict(f.metadata() or {})
    meta.update({"dtype": "float16", **(extra or {})})
    tensors = {k: v.to(torch.float16).contiguous() for k, v in load_file(os.fspath(src)).items()}
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, dest)


def _train_stage(args: argparse.Namespace, out: Path, gguf: Path, model: Any, split: Any) -> dict[str, Any]:
    from clients.hat.adapter import Adapter

    corpus = read_corpus(out / "corpus.jsonl")
    train_ex, held_ex = split_corpus(corpus)
    if not train_ex:
        raise SystemExit(f"no training sequences in {out / 'corpus.jsonl'}: run --stage corpus first")
    progress = not args.quiet
    t0 = time.monotonic()
    train = load_features(split, train_ex, out / "features", args.model, args.max_len, False, progress, "features")
    held = load_features(split, held_ex, out / "features", args.model, args.max_len, True, progress, "held-out")
    feature_seconds = time.monotonic() - t0
    opts = TrainOptions(
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        lr_min=args.lr_min,
        w_ce=args.w_ce,
        ce_vocab=args.ce_vocab,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        eval_every=args.eval_every,
        time_budget_s=args.time_budget * 60 if args.time_budget else None,
        answers_only=args.answers_only,
    )
    loss_from = max(common_prefix_len([e.prompt_ids for e in train_ex]) - 1, 0) if not args.loss_on_header else 0
    frequent = frequent_tokens((e.ids for e in train_ex), opts.ce_vocab // 2)
    if args.init_adapter:  # warm start: continue from a trained adapter (e.g. the shipped one) on this corpus
        adapter = Adapter.load(model, args.init_adapter)
        if adapter.m != args.m:
            raise SystemExit(f"--init-adapter {args.init_adapter} was trained for m={adapter.m}, not m={args.m}")
    else:
        adapter = Adapter(model, args.m)
    trainer = Trainer(split, adapter, train, opts, loss_from, frequent, held)
    ckpt = out / "checkpoint"
    if not ckpt.exists() and (out / "checkpoint.old").exists():
        os.replace(out / "checkpoint.old", ckpt)  # a crash between the two renames of save_checkpoint
    fresh = True
    if ckpt.exists():
        if not args.resume:
            raise SystemExit(f"{ckpt} exists: pass --resume to continue it, or remove it to start over")
        state = trainer.load_checkpoint(ckpt)
        fresh = False
        if args.steps != state["options"]["steps"]:
            trainer.total_steps = max(args.steps, trainer.step)  # an explicit new length
        print(f"resumed at step {trainer.step}/{trainer.total_steps}", file=sys.stderr)
    reason = trainer.fit(ckpt, progress=progress, fresh=fresh)
    adapter.eval()
    adapter.save(out / "adapter.safetensors", {"model": args.model, "steps": str(trainer.step)})
    summary = {
        **_model_info(args.model, gguf),
        "m": args.m,
        "steps": trainer.step,
        "scheduled_steps": trainer.total_steps,
        "stopped_by": reason,
        "train_seconds": round(trainer.train_seconds, 1),
        "feature_seconds_this_run": round(feature_seconds, 1),
        "options": asdict(opts),
        "loss_from_position": loss_from,
        "init_adapter": args.init_adapter or None,
        "final": trainer.history[-1] if trainer.history else {},
        "evals": trainer.evals,
        "corpus": corpus_stats(corpus),
    }
    (out / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _report_stage(args: argparse.Namespace, out: Path, gguf: Path, model: Any, split: Any) -> dict[str, Any]:
    from clients.hat.adapter import Adapter

    corpus = read_corpus(out / "corpus.jsonl")
    train_ex, held_ex = split_corpus(corpus)
    if not held_ex:
        raise SystemExit("no held-out sequences in the corpus")
    progress = not args.quiet
    held = load_features(split, held_ex, out / "features", args.model, args.max_len, True, progress, "held-out")
    trained_path = Path(args.adapter) if args.adapter else out / "adapter.safetensors"
    variants: dict[str, Any] = {"no_adapter": lambda s: s, "untrained": Adapter(model, args.m).eval()}
    if trained_path.exists():
        variants["trained"] = Adapter.load(model, trained_path).eval()
    best = variants.get("trained", variants["untrained"])
    variants = {k: v for k, v in variants.items() if k in args.variants}
    etas = sorted({args.eta, 0.4, 0.8})
    report: dict[str, Any] = {
        **_model_info(args.model, gguf),
        "m": args.m,
        "eta": args.eta,
        "max_draft": 8,
        "held_out_prompts": len(held),
        "held_out_tokens": sum(f.ids.shape[0] for f in held),
        "held_out_response_tokens": sum(f.ids.shape[0] - f.prompt_len for f in held),
        "trained_adapter": str(trained_path) if trained_path.exists() else None,
        "variants": {},
    }
    for name, fn in variants.items():
        t0 = time.monotonic()
        preds = predict(split, fn, held, None, None)
        report["variants"][name] = {
            **top1_agreement(split, fn, held, preds=preds),
            "rounds": accept_length(split, fn, held, etas, preds=preds),
        }
        print(f"report: {name} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.draft_vocab:
        freq_all = frequent_tokens((e.ids for e in train_ex), max(args.draft_vocab))
        timing = {"full": time_draft_step(split, best)}
        report["draft_vocab"] = {}
        resp_targets = torch.cat([f.teacher_top1[response_slice(f)] for f in held])
        for k in args.draft_vocab:
            vocab = torch.tensor(sorted(freq_all[:k]), dtype=torch.long)
            covered = float(torch.isin(resp_targets, vocab).float().mean())
            preds = predict(split, best, held, vocab, None)
            report["draft_vocab"][str(k)] = {
                "coverage_of_llm_tokens": covered,
                **top1_agreement(split, best, held, preds=preds),
                "rounds": accept_length(split, best, held, etas, preds=preds),
                "timing": time_draft_step(split, best, vocab=vocab),
            }
        report["draft_vocab_full_timing"] = timing["full"]
    if args.baseline:
        trained_vocab = Path(args.trained_vocab) if args.trained_vocab else None
        contenders = {
            "baseline": (Adapter.load(model, args.baseline).eval(), _vocab(args.baseline_vocab)),
            "trained": (best, _vocab(trained_vocab)),
        }
        report["side_by_side"] = side_by_side(split, held, contenders, args.eta)
        report["side_by_side_files"] = {
            "baseline": [args.baseline, args.baseline_vocab or None],
            "trained": [str(trained_path), str(trained_vocab) if trained_vocab else None],
        }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print_report(report)
    return report


def _vocab(path: str | os.PathLike[str] | None) -> torch.Tensor | None:
    """A draft vocabulary file's token ids (sorted), or None for the full vocabulary."""
    if not path:
        return None
    ids = json.loads(Path(path).read_text())["token_ids"]
    return torch.tensor(sorted(set(ids)), dtype=torch.long)


def _ship(args: argparse.Namespace, out: Path, argv: Sequence[str], wall_s: float) -> Path:
    """Copy the trained adapter (float16) to --ship, with a JSON record of how it was made and how it scores."""
    dest = Path(args.ship)
    save_fp16(out / "adapter.safetensors", dest)
    info: dict[str, Any] = {
        "file": dest.name,
        "dtype": "float16",
        "command": " ".join(["tandem", "train-adapter", *argv]),
    }
    for name in ("train.json", "report.json"):
        p = out / name
        if p.exists():
            info[name.removesuffix(".json")] = json.loads(p.read_text())
    if info.get("report", {}).get("variants"):  # (a side-by-side-only report has its numbers under side_by_side)
        rep = info["report"]
        eta = rep["eta"]
        info["held_out"] = {
            name: {
                "top1_response": v["top1_response"],
                "top1_all": v["top1_all"],
                "accept_length_send_low": v["rounds"][f"eta={eta:g},send_low"]["accept_length"],
                "accept_length_stop_before_low": v["rounds"][f"eta={eta:g},stop_before_low"]["accept_length"],
            }
            for name, v in rep["variants"].items()
        }
    info["wall_seconds_this_invocation"] = round(wall_s, 1)
    dest.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
    return dest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem train-adapter",
        description="Distil the HAT adapter on text the LLM generates itself (corpus -> train -> report).",
    )
    p.add_argument("--stage", choices=["corpus", "train", "report", "all"], default="all")
    p.add_argument("--out", default="var/adapter", help="working directory (corpus, features, checkpoints, report)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="bundled model name (deploy/models.py)")
    p.add_argument("--m", type=int, default=DEFAULT_M, help="split after this many decoder layers")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature for training answers")
    p.add_argument(
        "--code-prompts",
        type=int,
        default=0,
        help="corpus: also this many code-reading prompts built from the Python standard library's source",
    )
    p.add_argument("--code-max-tokens", type=int, default=2048, help="longest code-reading prompt (tokens)")
    p.add_argument("--code-max-new-tokens", type=int, default=128, help="answer cap for the code-reading prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-min", type=float, default=1e-4)
    p.add_argument("--w-ce", type=float, default=0.1, help="weight of the CE term (HAT Eq. 4: 0.1)")
    p.add_argument("--ce-vocab", type=int, default=4096, help="CE vocabulary subset size (0 = full vocabulary)")
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--answers-only", action="store_true", help="train on answer positions only (not the prompts)")
    p.add_argument("--loss-on-header", action="store_true", help="also train on the shared chat-template header")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=200, help="held-out top-1 on a few sequences every N steps")
    p.add_argument("--threads", type=int, default=1, help="torch and llama.cpp threads")
    p.add_argument("--time-budget", type=float, default=None, help="stop training after this many minutes")
    p.add_argument("--resume", action="store_true", help="continue training from the checkpoint in --out")
    p.add_argument("--eta", type=float, default=0.6)
    p.add_argument(
        "--draft-vocab",
        type=int,
        nargs="*",
        default=[],
        help="report: also evaluate reduced draft vocabularies of these sizes (most frequent corpus tokens)",
    )
    p.add_argument(
        "--save-draft-vocab", type=int, default=0, help="write the K most frequent corpus tokens as a draft vocabulary"
    )
    p.add_argument(
        "--adapter", default=None, help="report: adapter file to evaluate (default: <out>/adapter.safetensors)"
    )
    p.add_argument(
        "--variants",
        nargs="*",
        default=["no_adapter", "untrained", "trained"],
        help="report: which draft models to score over the full vocabulary (each is a full-vocabulary head pass)",
    )
    p.add_argument("--init-adapter", default=None, help="train: start from this adapter file (warm start)")
    p.add_argument(
        "--draft-vocab-base",
        default=None,
        help="--save-draft-vocab: also keep every token of this earlier draft vocabulary (its corpus' tokens)",
    )
    p.add_argument("--baseline", default=None, help="report: an adapter to compare with side by side (chat / code)")
    p.add_argument("--baseline-vocab", default=None, help="report: the baseline's draft vocabulary (default: full)")
    p.add_argument(
        "--trained-vocab", default=None, help="report: the trained adapter's draft vocabulary (side by side)"
    )
    p.add_argument("--ship", default=None, help="after training/report, write the float16 adapter + JSON here")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    t_start = time.monotonic()
    from deploy.models import fetch, model_path

    torch.set_num_threads(max(1, args.threads))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = model_path(args.model)
    if not gguf.exists():
        gguf = fetch(args.model)
    stages = ["corpus", "train", "report"] if args.stage == "all" else [args.stage]
    prompts = load_prompts(args.prompts)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    if "corpus" in stages:
        tokenizer = load_tokenizer(gguf)
        corpus = read_corpus(out / "corpus.jsonl")
        if args.code_prompts:
            # The code-reading prompts first (long prompts, short answers: a larger context), then the chat prompts,
            # held-out ones first, so a run stopped early still has both held-out sets.
            code = build_code_prompts(tokenizer, args.code_prompts, args.seed, max_tokens=args.code_max_tokens)
            code_cfg = CorpusConfig(
                max_new_tokens=args.code_max_new_tokens,
                temperature=args.temperature,
                seed=args.seed,
                threads=args.threads,
                n_ctx=4096,
            )
            by_index = {CODE_INDEX_BASE + j: p for j, p in enumerate(code)}
            corpus = generate_corpus(by_index, out / "corpus.jsonl", gguf, tokenizer, code_cfg, progress=not args.quiet)
        cfg = CorpusConfig(
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, threads=args.threads
        )
        order = sorted(range(len(prompts)), key=lambda i: (not is_held_out(i), i))
        corpus = generate_corpus(
            prompts, out / "corpus.jsonl", gguf, tokenizer, cfg, indices=order, progress=not args.quiet
        )
        stats = corpus_stats(corpus)
        print(f"corpus: {json.dumps(stats)}", file=sys.stderr)
    model = split = None
    if "train" in stages or "report" in stages:
        model, _, split = _load_split(gguf, args.m)
    if "train" in stages:
        summary = _train_stage(args, out, gguf, model, split)
        print(
            f"trained {summary['steps']} steps in {summary['train_seconds']:.0f} s ({summary['stopped_by']}); "
            f"adapter: {out / 'adapter.safetensors'}",
            file=sys.stderr,
        )
    if args.save_draft_vocab:
        train_ex, _ = split_corpus(read_corpus(out / "corpus.jsonl"))
        ids = frequent_tokens((e.ids for e in train_ex), args.save_draft_vocab)
        if args.draft_vocab_base:
            # The tokens of an earlier vocabulary's corpus (kept as its id list: that corpus may be gone) are part
            # of the larger corpus this vocabulary is cut from.
            ids = set(ids) | set(json.loads(Path(args.draft_vocab_base).read_text())["token_ids"])
        ids = sorted(ids)
        dest = Path(args.ship).with_suffix(".draft-vocab.json") if args.ship else out / "draft-vocab.json"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(json.dumps({"model": args.model, "k": len(ids), "token_ids": ids}) + "\n")
    if "report" in stages:
        _report_stage(args, out, gguf, model, split)
    if args.ship:
        if not (out / "adapter.safetensors").exists():
            raise SystemExit(f"nothing to ship: {out / 'adapter.safetensors'} does not exist")
        dest = _ship(args, out, argv, time.monotonic() - t_start)
        print(f"shipped {dest} (+ {dest.with_suffix('.json').name})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
