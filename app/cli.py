"""tandem serve | worker | models | train-adapter | profile | bench — the one entry point (`tandem` console script).

The composition root of the product and of the offline tools: `bench`, `train-adapter` and `profile` import app/tools/
inside their handlers only, so serving never loads the tools (nor their extra's packages)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.config import ConfigError, embedded_default, load_settings
    from app.http_protocol import HttpProtocol
    from app.serving.gateway import create_gateway
    from deploy.models import ModelError

    try:
        settings = load_settings(args.config or embedded_default())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gw = settings.gateway
    if args.reset_budget and gw.state_file:
        state = Path(gw.state_file).expanduser()
        state.unlink(missing_ok=True)
        print(f"budget settings: {state} deleted, the config's apply", file=sys.stderr)
    host = args.host or gw.host
    port = gw.port if args.port is None else args.port
    logging.basicConfig(level=gw.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if gw.log_level != "debug":
        # httpx logs every upstream request at INFO, before it hands the answer over: a log write on each
        # first token's path that the request trace (GET /v1/requests/{id}) already covers.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        app = create_gateway(settings)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"Tandem gateway on http://{host}:{port}/v1 (models load in the background; GET /health/ready says when)",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        http=HttpProtocol.reading_within(gw.request_read_timeout),
        limit_concurrency=gw.max_connections,
        log_level=gw.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return 0


def _worker(args: argparse.Namespace) -> int:
    """The HAT cloud worker: hosts the middle layers of a split LLM (see ARCHITECTURE.md)."""
    from app.config import ConfigError, load_worker_settings
    from app.worker.server import serve_worker

    flags = {
        "model": args.model,
        "m": args.m,
        "host": args.host,
        "port": args.port,
        "num_threads": args.threads,
        "device": args.device,
        "stages": args.stages,
        # Comma-separated values, converted (and refused, naming the field) by the settings' validation.
        "stage_threads": args.stage_threads.split(",") if args.stage_threads else None,
        "stage_memory_gib": args.stage_memory_gib.split(",") if args.stage_memory_gib else None,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "sequence_partition": args.sequence_partition,
        "profile": args.profile,
        "prefill_profile": args.prefill_profile,
        # A stage started by hand on another host: stage 0 does not spawn it.
        "spawn_stages": False if args.stage_rank else None,
    }
    try:
        settings = load_worker_settings(args.config, flags)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.stage_rank:
        from app.worker.remote_stage import serve_stage

        if not 0 < args.stage_rank < settings.stages:
            print(f"error: --stage-rank must be in 1..{settings.stages - 1}", file=sys.stderr)
            return 2
        return serve_stage(settings, args.stage_rank)
    serve_worker(settings)
    return 0


def _train_adapter(args: argparse.Namespace) -> int:
    from app.tools.training.train_adapter import main

    return main(args.rest)


def _profile(args: argparse.Namespace) -> int:
    from app.tools.profiling.main import main

    return main(args.rest)


def _models(args: argparse.Namespace) -> int:
    from deploy import models

    if args.action == "list":
        for name, m in models.MODELS.items():
            state = "verified" if models.is_verified(name) else "not fetched"
            print(f"{name:32s} {m.size / 1e6:8.1f} MB  {state:12s} {models.model_path(name)}")
        return 0
    return models.main([args.action, *args.names])


def _bench(args: argparse.Namespace) -> int:
    if args.what == "gateway":
        from app.tools.bench.gateway_bench import main
    elif args.what == "disco":
        from app.tools.bench.disco_sim import main
    elif args.what == "disco-live":
        from app.tools.bench.disco_live import main
    elif args.what == "hat":
        from app.tools.bench.hat import main
    elif args.what == "hat-streams":
        from app.tools.bench.hat_streams import main
    elif args.what == "hat-resume":
        from app.tools.bench.hat_resume import main
    elif args.what == "fair-share":
        from app.tools.bench.fair_share_bench import main
    elif args.what == "device":
        from app.tools.bench.device_bench import main
    elif args.what == "sd-edge":
        from app.tools.bench.sd_edge_bench import main
    elif args.what == "worker-batching":
        from app.tools.bench.worker_batching_bench import main
    elif args.what == "worker-compute":
        from app.tools.bench.worker_compute import main
    elif args.what == "privacy":
        from app.tools.bench.privacy_bench import main
    elif args.what == "outline":
        from app.tools.bench.outline_bench import main
    elif args.what == "jupiter":
        from app.tools.bench.jupiter_bench import main
    elif args.what == "reproducible":
        from app.tools.bench.reproducible import main
    elif args.what == "fleet":
        from app.tools.bench.fleet_bench import main
    elif args.what == "events":
        from app.tools.bench.events_bench import main
    elif args.what == "quality":
        from app.tools.bench.quality_bench import main
    elif args.what == "agents":
        from app.tools.bench.agents_bench import main
    elif args.what == "prompt-cache":
        from app.tools.bench.prompt_cache_bench import main
    else:  # pragma: no cover - argparse restricts choices
        raise AssertionError(args.what)
    return main(args.rest)


def _check_cloud(args) -> int:
    from app.check_cloud import run
    from app.config import ConfigError, embedded_default, load_settings

    try:
        settings = load_settings(args.config or embedded_default())
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    return run(settings, args.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Device-cloud LLM serving gateway")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible gateway")
    serve.add_argument("--config", help="TOML settings file (default: the embedded default)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--reset-budget",
        action="store_true",
        help="forget budget settings changed over PUT /v1/budget (gateway.state_file): start from the config's",
    )
    serve.set_defaults(func=_serve)

    worker = sub.add_parser(
        "worker",
        help="run a HAT worker (the middle layers of a split LLM)",
        epilog="Each flag sets the [worker] field it names, over TANDEM_WORKER__<FIELD> variables, which are over the "
        "--config file's [worker] table. Every field with its default: app/worker/settings.py. The device token "
        "comes from the environment only: TANDEM_WORKER__AUTH_TOKEN or TANDEM_WORKER_AUTH_TOKEN.",
    )
    worker.add_argument("--config", help="TOML file with a [worker] table")
    worker.add_argument("--model", help="bundled model name or GGUF path ([worker] model)")
    worker.add_argument("--m", type=int, help="decoder layers kept on the device ([worker] m)")
    worker.add_argument("--host", help="[worker] host")
    worker.add_argument("--port", type=int, help="[worker] port")
    worker.add_argument("--threads", type=int, help="torch threads ([worker] num_threads)")
    worker.add_argument("--device", help="where the middle layers run ([worker] device)")
    worker.add_argument(
        "--stages", type=int, help="pipeline stages P: processes the middle layers are split over ([worker] stages)"
    )
    worker.add_argument(
        "--stage-threads", help="torch threads per stage, comma-separated, e.g. 2,1 ([worker] stage_threads)"
    )
    worker.add_argument(
        "--stage-memory-gib",
        help="memory cap per stage in GiB, comma-separated, e.g. 2,1.5 ([worker] stage_memory_gib)",
    )
    worker.add_argument("--stage-rank", type=int, default=0, help="run only stage s >= 1 of a staged worker")
    worker.add_argument("--master-addr", help="the stages' rendezvous address ([worker] master_addr)")
    worker.add_argument("--master-port", type=int, help="the stages' rendezvous port ([worker] master_port)")
    worker.add_argument(
        "--sequence-partition", help="how stage 0 re-splits prefill frames ([worker] sequence_partition)"
    )
    worker.add_argument("--profile", help="a `tandem profile` JSON ([worker] profile)")
    worker.add_argument(
        "--prefill-profile",
        action=argparse.BooleanOptionalAction,
        help="profile the prefill cost tau at start-up ([worker] prefill_profile)",
    )
    worker.set_defaults(func=_worker)

    prof = sub.add_parser("profile", help="measure this device and a HAT worker (see --help)", add_help=False)
    prof.add_argument("rest", nargs=argparse.REMAINDER)
    prof.set_defaults(func=_profile)

    train = sub.add_parser("train-adapter", help="distil the HAT draft adapter (see --help)", add_help=False)
    train.add_argument("rest", nargs=argparse.REMAINDER)
    train.set_defaults(func=_train_adapter)

    check = sub.add_parser(
        "check-cloud",
        help="ask a configured cloud for one answer and one continuation in its dialect; say what it did",
    )
    check.add_argument("name", help="the cloud's name in [clouds]")
    check.add_argument("--config", help="TOML settings file (default: the embedded default)")
    check.set_defaults(func=_check_cloud)

    mod = sub.add_parser("models", help="list, fetch or locate the bundled model weights")
    mod.add_argument("action", choices=["list", "fetch", "path"])
    mod.add_argument("names", nargs="*")
    mod.set_defaults(func=_models)

    bench = sub.add_parser("bench", help="run a benchmark (see BENCHMARKS.md)")
    bench.add_argument(
        "what",
        choices=[
            "gateway",
            "device",
            "disco",
            "disco-live",
            "hat",
            "hat-streams",
            "hat-resume",
            "fair-share",
            "sd-edge",
            "worker-batching",
            "worker-compute",
            "privacy",
            "outline",
            "jupiter",
            "reproducible",
            "fleet",
            "events",
            "quality",
            "agents",
            "prompt-cache",
        ],
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)

    argv = sys.argv[1:] if argv is None else argv
    # Their own parsers: argparse's REMAINDER cannot start with an --option.
    if argv[:1] == ["train-adapter"]:
        return _train_adapter(argparse.Namespace(rest=argv[1:]))
    if argv[:1] == ["profile"]:
        return _profile(argparse.Namespace(rest=argv[1:]))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
