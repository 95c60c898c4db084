"""``judge serve``: the HTTP service on one engine, loaded in the background at start-up.

With ``--ray`` the same app runs as Ray Serve replicas behind one endpoint
(``service.web.ray_serve``), a fixed number (``--replicas``) or autoscaled
(``--min-replicas``/``--max-replicas``/``--target-ongoing-requests``).

Stopping is bounded and clean: on SIGTERM or Ctrl-C the server stops accepting connections,
gives the requests in flight ``--shutdown-timeout`` seconds to finish, cancels the rest (which
drops their queued model work), and exits with status 0.

The server's settings are ``service.config.ServiceConfig``'s: each carries its flag, and
``add_arguments`` makes the flags from them (``service_config`` reads them back), so a new
setting is one edit there. The flags declared here are the engine's, uvicorn's and Ray's.
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from judge import DEFAULT_PREFIX_CACHE_MB
from service.command_line import (
    UsageError,
    add_settings,
    choice_paths_argument,
    device_argument,
    dtype_argument,
    megabytes,
    positive_int,
    seconds,
    settings_of,
)
from service.config import ServiceConfig
from service.install import install_hint, missing_adapter_extra

if TYPE_CHECKING:
    from judge import Engine
    from service.web.ray_serve import Scaling

__all__ = [
    "add_arguments",
    "run",
    "run_ray",
    "scaling",
    "service_config",
]

log = logging.getLogger("judge.service")


def add_arguments(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``judge serve``: the engine's and the server's flags, the settings' from ServiceConfig."""
    # No abbreviations: `--api-key KEY` must not pass for `--api-key-file KEY`.
    serve = commands.add_parser(
        "serve", help="run the HTTP service (POST /judge)", allow_abbrev=False
    )
    serve.add_argument("--model", default=None, help="model id, directory or .gguf")
    dtype_argument(serve)
    device_argument(serve)
    choice_paths_argument(serve)
    serve.add_argument(
        "--batch-variant",
        action="store_true",
        help="faster arithmetic, without the guarantee that a judgment's probabilities do "
        "not depend on its batch or the prefix cache (in bfloat16 they move by up to 0.02)",
    )
    serve.add_argument(
        "--generic-pass",
        action="store_true",
        help="run the model's own decoder instead of the lean pass that Llama-family models "
        "take (slower; as exact; for comparison)",
    )
    serve.add_argument(
        "--prefix-cache-mb",
        type=megabytes,
        default=DEFAULT_PREFIX_CACHE_MB,
        help="memory for cached prompt prefixes, reused across requests (0: off)",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0: every "
        "interface)",
    )
    serve.add_argument(
        "--port", type=int, default=8000, help="the TCP port to listen on (default: 8000)"
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=seconds,
        default=20.0,
        help="on SIGTERM or Ctrl-C, seconds to finish requests in flight before cancelling "
        "them (default: 20, within the usual 30 s grace period)",
    )
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="the server's log level (default: info)",
    )
    groups = {
        None: serve,
        "log": serve.add_argument_group(
            "the decision log (feedback, audit, health)",
            "Every decision appended to a database before its response is sent; labels taken "
            "at POST /judgments/{id}/label and POST /labels; each profile's health at "
            "GET /profiles/{name}/health and /metrics.",
        ),
    }
    add_settings(groups)
    scale = serve.add_argument_group(
        "scaling out on Ray Serve (the ray extra)",
        "Replicas of the service behind one endpoint, each with its own model; profiles are "
        "shared through --profiles-dir, which every replica must reach.",
    )
    scale.add_argument("--ray", action="store_true", help="serve with Ray Serve replicas")
    scale.add_argument(
        "--replicas", type=positive_int, help="a fixed number of replicas (default: 1)"
    )
    scale.add_argument(
        "--min-replicas", type=int, help="autoscale: at least this many replicas (0 allowed)"
    )
    scale.add_argument("--max-replicas", type=positive_int, help="autoscale: at most this many")
    scale.add_argument(
        "--target-ongoing-requests",
        type=float,
        help="autoscale: requests in flight per replica that Ray aims for",
    )
    scale.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica (default: 1)"
    )
    scale.add_argument(
        "--ray-address",
        help="join this Ray cluster (e.g. ray://head:10001 or auto); default: start a local one",
    )
    serve.set_defaults(run=run)


def service_config(args: argparse.Namespace) -> ServiceConfig:
    """The settings ``judge serve``'s flags give (each setting's own default where not given)."""
    return ServiceConfig(**settings_of(args))


def run(args: argparse.Namespace) -> int:
    # Imported here: `judge ask` and `judge calibrate` need neither litestar nor uvicorn.
    import uvicorn

    from judge.engines import open_engine
    from service import create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = service_config(args)
    if config.refit_adapters and (missing := missing_adapter_extra()) is not None:
        raise UsageError(f"--refit-adapters: {missing}")
    loader = functools.partial(
        open_engine,
        args.model,
        dtype=args.dtype,
        device=args.device,
        prefix_cache_mb=args.prefix_cache_mb,
        batch_invariant=not args.batch_variant,
        lean=not args.generic_pass,
        choice_paths=args.choice_paths,
        **config.engine_options,  # the engine packs passes to --max-batch-tokens too
    )
    if getattr(args, "ray", False):
        return run_ray(args, loader, config)
    app = create_app(loader=loader, config=config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=max(1, round(args.shutdown_timeout)),
        )
    )
    # uvicorn shuts down gracefully on these signals, then raises the signal again with the
    # handlers that were in place before it started; these make that a no-op, so a stop that
    # went as planned exits 0 instead of dying of the signal.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("stopped")
    return 0


def scaling(args: argparse.Namespace) -> Scaling:
    """The replicas asked for on the command line; a bad combination is a usage error."""
    from service.web.ray_serve import Scaling

    autoscaled = args.min_replicas is not None or args.max_replicas is not None
    try:
        return Scaling(
            replicas=args.replicas if args.replicas is not None or autoscaled else 1,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            replica_cpus=args.replica_cpus,
        )
    except ValueError as exc:  # Scaling names its fields; the user knows them as flags
        message = re.sub(
            r"\b(replicas|min_replicas|max_replicas|target_ongoing_requests|replica_cpus)\b",
            lambda m: "--" + m.group(1).replace("_", "-"),
            str(exc),
        )
        raise UsageError(f"serve --ray: {message}") from None


def run_ray(args: argparse.Namespace, loader: Callable[[], Engine], config: ServiceConfig) -> int:
    """``judge serve --ray``: replicas on Ray Serve, until Ctrl-C."""
    try:
        from service.web import ray_serve

        ray_serve.check_ray()
    except ImportError:
        raise UsageError(
            f"--ray: Ray Serve is not installed; install it with: {install_hint('ray')}"
        ) from None
    ray_serve.run(
        loader,
        config,
        scaling(args),
        host=args.host,
        port=args.port,
        address=args.ray_address,
    )
    log.info("stopped")
    return 0
