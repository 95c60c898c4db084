"""``judge serve``: the HTTP service on one engine, loaded in the background at start-up.

With ``--ray`` the same app runs as Ray Serve replicas behind one endpoint
(``service.ray_serve``), a fixed number (``--replicas``) or autoscaled
(``--min-replicas``/``--max-replicas``/``--target-ongoing-requests``).

Stopping is bounded and clean: on SIGTERM or Ctrl-C the server stops accepting connections,
gives the requests in flight ``--shutdown-timeout`` seconds to finish, cancels the rest (which
drops their queued model work), and exits with status 0.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.cli.common import UsageError

if TYPE_CHECKING:
    from judge import Engine
    from service import ServiceConfig
    from service.ray_serve import Scaling

__all__ = ["api_key", "audit_rates", "run", "run_ray", "scaling"]

log = logging.getLogger("judge.service")


def api_key(path: Path | None) -> str | None:
    """The API key: the first line of ``path``, else $JUDGE_API_KEY, else None (no auth)."""
    if path is None:
        return os.environ.get("JUDGE_API_KEY") or None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"--api-key-file: cannot read {path}: {exc.strerror}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise UsageError(f"--api-key-file: {path} is empty; its first line is the key")
    return key


def audit_rates(given: list[tuple[str | None, float]]) -> dict[str, Any]:
    """``--audit-rate`` as ServiceConfig's ``audit_rate`` and ``audit_rates``."""
    rates: dict[str, float] = {}
    server = 0.0
    for name, rate in given:
        if name is None:
            server = rate
        else:
            rates[name] = rate
    return {"audit_rate": server, "audit_rates": rates}


def run(args: argparse.Namespace) -> int:
    # Imported here: `judge ask` and `judge calibrate` need neither litestar nor uvicorn.
    import uvicorn

    from judge import Judge
    from service import ServiceConfig, create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = ServiceConfig(
        profiles_dir=args.profiles_dir,
        max_batch_size=args.max_batch_size,
        max_batch_tokens=args.max_batch_tokens,
        max_request_tokens=args.max_request_tokens,
        max_questions=args.max_questions,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        admission_wait_s=args.admission_wait,
        request_timeout_s=args.request_timeout,
        fit_timeout_s=args.fit_timeout,
        read_timeout_s=args.read_timeout,
        api_key=api_key(args.api_key_file),
        max_body_bytes=args.max_body_bytes,
        default_threshold=args.default_threshold,
        min_choice_mass=args.min_choice_mass,
        decision_log=args.decision_log,
        log_requests=args.log_requests,
        log_max_age_days=args.log_max_age_days,
        log_max_rows=args.log_max_rows,
        **audit_rates(args.audit_rate or []),
    )
    loader = functools.partial(
        Judge.load,
        args.model,
        dtype=args.dtype,
        device=args.device,
        prefix_cache_mb=args.prefix_cache_mb,
        batch_invariant=not args.batch_variant,
        lean=not args.generic_pass,
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
    from service.ray_serve import Scaling

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
        flags = re.sub(
            r"\b(replicas|min_replicas|max_replicas|target_ongoing_requests|replica_cpus)\b",
            lambda m: "--" + m.group(1).replace("_", "-"),
            str(exc),
        )
        raise UsageError(f"serve --ray: {flags}") from None


def run_ray(args: argparse.Namespace, loader: Callable[[], Engine], config: ServiceConfig) -> int:
    """``judge serve --ray``: replicas on Ray Serve, until Ctrl-C."""
    try:
        from service import ray_serve

        ray_serve.check_ray()
    except ImportError:
        raise UsageError(
            "--ray: Ray Serve is not installed; install it with: pip install -e '.[ray]'"
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
