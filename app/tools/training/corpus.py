"""Training text for the HAT adapter: the prompt file, its held-out rule, and the corpus the LLM writes itself.

The LLM answers every prompt of deploy/adapter_prompts.txt through its chat template, with llama.cpp on the
bundled GGUF (fast). Training prompts are sampled (temperature 0.7, seeded per prompt); held-out prompts (every
8th, see the prompt file's header) are answered greedily, because the acceptance report simulates greedy HAT
rounds on them. Each answer is appended to corpus.jsonl as token ids as soon as it is done; a rerun skips the
prompts already answered with the same settings. Only JSON is written or read here: never pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.tools import REPO_ROOT, import_extra

DEFAULT_PROMPTS = REPO_ROOT / "deploy" / "adapter_prompts.txt"
HELD_OUT_EVERY = 8  # prompt i is held out when i % 8 == 7


def load_prompts(path: str | os.PathLike[str]) -> list[str]:
    """One prompt per line; '#' lines and blank lines are skipped; a literal backslash-n is a newline."""
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        prompts.append(s.replace("\\n", "\n"))
    return prompts


def is_held_out(index: int) -> bool:
    return index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def short_sha(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


@dataclass
class CorpusConfig:
    max_new_tokens: int = 192
    temperature: float = 0.7  # training prompts; held-out prompts are answered greedily
    top_p: float = 0.95
    seed: int = 0
    threads: int = 1
    n_ctx: int = 2048


@dataclass
class Example:
    """One corpus record: the chat-templated prompt and the LLM's answer, as token ids."""

    index: int
    held_out: bool
    prompt_ids: list[int]
    response_ids: list[int]
    finish: str = "stop"
    key: str = ""  # identifies prompt text + generation settings (resume skips records whose key matches)
    temperature: float = 0.0
    seconds: float = 0.0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


def _record_key(prompt: str, cfg: CorpusConfig, held_out: bool, index: int) -> str:
    temp = 0.0 if held_out else cfg.temperature
    return short_sha(f"{prompt}\x00{cfg.max_new_tokens}\x00{temp}\x00{cfg.top_p}\x00{cfg.seed}\x00{index}")


def read_corpus(path: str | os.PathLike[str]) -> dict[int, Example]:
    """The corpus records by prompt index (a later record for the same index wins; a torn last line is ignored)."""
    out: dict[int, Example] = {}
    p = Path(path)
    if not p.exists():
        return out
    with open(p, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: that prompt is generated again
            out[int(rec["index"])] = Example(**rec)
    return out


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt as one user message through the model's chat template, ready for generation."""
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_tokenizer(gguf: Path) -> Any:
    """The HF tokenizer of the converted model (converting the GGUF once if needed)."""
    from clients.hf_model import _is_complete, converted_dir, load_hf_model

    folder = converted_dir(gguf)
    if not _is_complete(folder):
        return load_hf_model(gguf)[1]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def generate_corpus(
    prompts: Sequence[str] | Mapping[int, str],
    out_path: str | os.PathLike[str],
    gguf: Path,
    tokenizer: Any,
    cfg: CorpusConfig,
    indices: Iterable[int] | None = None,
    progress: bool = True,
) -> dict[int, Example]:
    """Answer every prompt not yet in `out_path` with llama.cpp, appending one JSON line per answer.

    `prompts` is a list (corpus index = position) or a mapping from corpus index to prompt (the code-reading
    prompts live at app.tools.training.code_prompts.CODE_INDEX_BASE + j); `indices` picks and orders the ones to answer.
    """
    tqdm = import_extra("tqdm").tqdm
    done = read_corpus(out_path)
    todo = []
    if indices is None:
        indices = sorted(prompts) if isinstance(prompts, Mapping) else range(len(prompts))
    for i in indices:
        key = _record_key(prompts[i], cfg, is_held_out(i), i)
        if i not in done or done[i].key != key:
            todo.append((i, key))
    if not todo:
        return done
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf),
        n_ctx=cfg.n_ctx,
        n_threads=cfg.threads,
        n_threads_batch=cfg.threads,
        seed=cfg.seed,
        verbose=False,
    )
    vocab = llm._model.vocab
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    total_new = 0
    t_start = time.monotonic()
    bar = tqdm(todo, desc="corpus", unit="prompt", disable=not progress, dynamic_ncols=True)
    with open(out_path, "a+", encoding="utf-8") as f:
        if f.tell() > 0:
            f.seek(f.tell() - 1)
            if f.read(1) != "\n":
                f.write("\n")  # a line torn by a crash: start the next record on a line of its own
        for i, key in bar:
            held = is_held_out(i)
            ids = chat_ids(tokenizer, prompts[i])
            budget = min(cfg.max_new_tokens, cfg.n_ctx - len(ids) - 1)
            temp = 0.0 if held else cfg.temperature
            llm.set_seed(cfg.seed * 1_000_003 + i)
            t0 = time.monotonic()
            response: list[int] = []
            finish = "length"
            if budget > 0:
                for tok in llm.generate(
                    ids,
                    temp=temp,
                    top_p=1.0 if temp <= 0 else cfg.top_p,
                    top_k=0,
                    min_p=0.0,
                    repeat_penalty=1.0,
                ):
                    response.append(int(tok))
                    if llama_cpp.llama_vocab_is_eog(vocab, tok):
                        finish = "stop"
                        break
                    if len(response) >= budget:
                        break
            ex = Example(i, held, ids, response, finish, key, temp, round(time.monotonic() - t0, 3))
            f.write(json.dumps(asdict(ex)) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done[i] = ex
            total_new += len(response)
            bar.set_postfix(tokens=total_new, tok_s=f"{total_new / max(time.monotonic() - t_start, 1e-6):.1f}")
    llm.close()
    return done


def corpus_stats(corpus: dict[int, Example]) -> dict[str, Any]:
    from app.tools.training.code_prompts import is_code_index

    train = [e for e in corpus.values() if not e.held_out]
    held = [e for e in corpus.values() if e.held_out]
    code = [e for e in corpus.values() if is_code_index(e.index)]
    return {
        "prompts": len(corpus),
        "code_prompts": len(code),
        "code_held_out_prompts": sum(e.held_out for e in code),
        "code_tokens": sum(len(e.ids) for e in code),
        "train_prompts": len(train),
        "held_out_prompts": len(held),
        "train_tokens": sum(len(e.ids) for e in train),
        "train_response_tokens": sum(len(e.response_ids) for e in train),
        "held_out_tokens": sum(len(e.ids) for e in held),
        "held_out_response_tokens": sum(len(e.response_ids) for e in held),
        "generation_seconds": round(sum(e.seconds for e in corpus.values()), 1),
    }


def split_corpus(corpus: dict[int, Example]) -> tuple[list[Example], list[Example]]:
    """(training, held-out) records, each in prompt order."""
    train = [corpus[i] for i in sorted(corpus) if not corpus[i].held_out]
    held = [corpus[i] for i in sorted(corpus) if corpus[i].held_out]
    return train, held


def frequent_tokens(seqs: Iterable[Sequence[int]], k: int) -> list[int]:
    """The k most frequent token ids (ties broken by id, so the list is reproducible)."""
    counts = Counter(t for s in seqs for t in s)
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the prefix every sequence shares (the chat template's fixed header, e.g. a default system prompt)."""
    if not seqs:
        return 0
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs[1:]):
            return i
    return n
