"""A request's trace (GET /v1/requests/{id}) and its line in a recorded trace file (`tandem bench disco --trace`),
both read from the orchestrator's `Job`."""

from __future__ import annotations

from app.serving.job import Job
from clients.dialects import RECORDED_FIELDS
from policies.dispatch import DispatchPlan

_BILLED = ("prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens")


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def plan_kind(plan: DispatchPlan) -> str:
    if plan.start_cloud and plan.start_device:
        return "race" if plan.device_delay == 0 else "cloud-then-device"
    return "cloud" if plan.start_cloud else "device"


def replay_row(job: Job) -> dict:
    """One line of a recorded trace for `tandem bench disco --trace` (format in app/tools/bench/disco_sim.py):
    each endpoint's time from its own start to its first token, when it got there."""

    def ttft(role: str, migration: bool) -> float | None:
        for a in job.attempts:
            if a.role == role and a.migration == migration and a.first_at is not None:
                return round(a.first_at - a.started, 6)
        return None

    return {
        "arrival": round(job.started, 6),
        "prompt_tokens": job.prompt_tokens,
        "server_ttft": ttft("cloud", False),
        "device_ttft": ttft("device", False),
        "output_tokens": job.usage.completion_tokens,
        "server_ttft_migration": ttft("cloud", True),
    }


def trace_of(job: Job) -> dict:
    plan = job.plan
    return {
        "id": job.id,
        "policy": job.policy,
        "privacy": job.privacy,
        # Who asked and the client's tags (`user`, `metadata`): kept here whichever endpoint serves.
        **{name: job.gen.extras[name] for name in RECORDED_FIELDS if name in job.gen.extras},
        **({"decoding": job.decoding} if job.decoding is not None else {}),
        "plan": None
        if plan is None
        else {
            "kind": plan_kind(plan),
            "policy": plan.policy,
            "reason": plan.reason,
            "device_delay_ms": ms(plan.device_delay),
        },
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.usage.completion_tokens,
        "ttft_ms": ms(job.ttft),
        "endpoints": [
            {
                "endpoint": a.role,
                "backend": a.name,
                "outcome": a.outcome,
                "started_ms": ms(a.started - job.started),
                "first_token_ms": ms(None if a.first_at is None else a.first_at - job.started),
                "ended_ms": ms(None if a.ended_at is None else a.ended_at - job.started),
                "prefill_tokens": a.context_tokens - a.cached_tokens,
                "cached_tokens": a.cached_tokens,
                "from_token": a.from_token,
                "decode_tokens": a.decode_tokens,
                # What it is booked for (its provider's own counts where it reported them): the ledger's view.
                "billed": dict(zip(_BILLED, a.billed(), strict=True)),
                **({"dialect": a.dialect} if a.dialect else {}),
                **({"seam": a.seam.describe()} if a.seam is not None else {}),
                **({"error": a.error} if a.error else {}),
                **({"ignored": a.ignored} if a.ignored else {}),
            }
            for a in job.attempts
        ],
        # The request's fields that an endpoint which delivered part of the answer did not apply, and why.
        **({"ignored_fields": ignored} if (ignored := job.ignored_fields()) else {}),
        **({"max_tokens_clamped": job.max_tokens_clamped} if job.max_tokens_clamped else {}),
        "migrations": job.migrations,
        "delayed_tokens": job.delayed_tokens,
        "cost_usd": job.cost,
        "finish_reason": job.finish_reason,
        **({"error": job.error} if job.error else {}),
    }
