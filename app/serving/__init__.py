"""The gateway's serving core: the gateway factory, the per-request orchestrator, DiSCo's live runtime, the
ledger of budget and spend, and metrics."""
