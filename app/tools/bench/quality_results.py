"""`tandem bench quality`'s per-problem results, committed under docs/bench/quality/ (docs/bench/quality/README.md):
one small JSON file per reported row, so that every figure can be re-graded from the repository (`--rescore`).

A row's file holds, per problem in HumanEval's order (no prompt: the task id names it): the answer's text, the code
read out of it, the sandbox's verdict, the tokens each endpoint computed (prefill) and wrote (decode), the bill per
endpoint from the ledger, the completed migrations, the finish reason, TTFT and the answer's time. Its keys are
sorted and its times rounded to the millisecond, so the same answers write the same bytes; a file over ~200 KB is
written gzipped (`.json.gz`, no timestamp in its header).

`--rescore` reads these files in place of the answer cache and the gateway: each answer is graded again in the
sandbox and its verdict and code compared with the committed ones.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from app.tools.bench import humaneval
from app.tools.bench.quality_configs import Config
from app.tools.bench.quality_scores import Scored

GZIP_ABOVE = 200_000  # bytes of JSON past which a row's file is written gzipped
FORMAT = 1


def folder(root: Path, which: str, sample: int | None, seed: int) -> Path:
    """A run's folder: the half's name for the whole half (`report`), else the sample's (`report-sample40-seed0`),
    so a sampled run never overwrites a whole half's results."""
    return Path(root) / (which if sample is None else f"{which}-sample{sample}-seed{seed}")


def slug(label: str) -> str:
    """A row's file name: its label with what a path cannot hold replaced (`policy:quality+stream=false` ->
    `policy-quality+stream=false`, `device>cloud@16` -> `device-to-cloud@16`)."""
    return label.replace(">", "-to-").replace(":", "-").replace("/", "-").replace(" ", "_")


def entry(record: dict, scored: Scored) -> dict:
    """One problem's committed result."""
    roles = sorted(set(scored.decode) | set(scored.prefill))
    return {
        "task_id": record["task_id"],
        "answer": record["answer"],
        "code": humaneval.extract_code(record["answer"]),
        "verdict": scored.verdict,
        "passed": scored.passed,
        "finish_reason": record["finish_reason"],
        "ttft_s": None if record["ttft_s"] is None else round(record["ttft_s"], 3),
        "seconds": round(record["seconds"], 3),
        "tokens": {r: {"prefill": scored.prefill.get(r, 0), "decode": scored.decode.get(r, 0)} for r in roles},
        "cost_usd": {role: record["cost_usd"][role] for role in sorted(record["cost_usd"])},
        "migrations": [{"at_token": m[0], "from": m[1], "to": m[2], "reason": m[3]} for m in scored.migrations],
    }


def write_row(directory: Path, label: str, header: dict, records: list[dict], scored: list[Scored]) -> Path:
    """A row's file (`header`: its standing, its description, the set-up), the problems in HumanEval's order."""
    entries = sorted(
        (entry(r, s) for r, s in zip(records, scored, strict=True)), key=lambda e: humaneval_number(e["task_id"])
    )
    data = {
        **header,
        "format": FORMAT,
        "configuration": label,
        "problems": len(entries),
        "passed": sum(e["passed"] for e in entries),
        "answers": entries,
    }
    text = json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    plain, zipped = directory / f"{slug(label)}.json", directory / f"{slug(label)}.json.gz"
    path, stale = (zipped, plain) if len(text.encode()) > GZIP_ABOVE else (plain, zipped)
    body = gzip.compress(text.encode(), mtime=0) if path is zipped else text.encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(body)
    tmp.replace(path)
    stale.unlink(missing_ok=True)
    return path


def read_row(directory: Path, label: str) -> dict | None:
    plain, zipped = directory / f"{slug(label)}.json", directory / f"{slug(label)}.json.gz"
    if plain.exists():
        return json.loads(plain.read_text())
    if zipped.exists():
        return json.loads(gzip.decompress(zipped.read_bytes()))
    return None


def humaneval_number(task_id: str) -> int:
    return int(task_id.rsplit("/", 1)[1])


def record_of(committed: dict) -> dict:
    """A committed result as the answer cache's record, for quality_scores.score: what the trace said, rebuilt."""
    return {
        "task_id": committed["task_id"],
        "answer": committed["answer"],
        "finish_reason": committed["finish_reason"],
        "ttft_s": committed["ttft_s"],
        "seconds": committed["seconds"],
        "cost_usd": {"device": 0.0, "cloud": 0.0, **committed["cost_usd"]},
        "trace": {
            "endpoints": [
                {"endpoint": role, "decode_tokens": t["decode"], "prefill_tokens": t["prefill"]}
                for role, t in committed["tokens"].items()
            ],
            "migrations": committed["migrations"],
        },
    }


class CommittedAnswers:
    """The committed results of one folder, read like the answer cache (`--rescore`): nothing is ever asked."""

    kind = "committed"

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self._rows: dict[str, dict | None] = {}

    def row(self, label: str) -> dict | None:
        if label not in self._rows:
            self._rows[label] = read_row(self.dir, label)
        return self._rows[label]

    def get(self, config: Config, task_id: str) -> dict | None:
        row = self.row(config.label)
        found = [a for a in row["answers"] if a["task_id"] == task_id] if row else []
        return record_of(found[0]) if found else None

    def put(self, config: Config, record: dict) -> None:
        raise RuntimeError("committed results are read only (--rescore never asks an answer)")

    def changes(self, label: str, scored: list[Scored]) -> list[str]:
        """The problems whose verdict, or the code read out of whose answer, is not the committed one."""
        committed = {a["task_id"]: a for a in self.row(label)["answers"]}
        changed = []
        for s in scored:
            was = committed[s.task_id]
            code = humaneval.extract_code(was["answer"])
            if (was["verdict"], was["passed"]) != (s.verdict, s.passed):
                changed.append(f"{s.task_id}: {was['verdict']} -> {s.verdict}")
            elif was["code"] != code:
                changed.append(f"{s.task_id}: the code read out of the answer changed")
        return changed
