"""``judge serve``: the HTTP service on one engine, loaded in the background at start-up."""

from __future__ import annotations

import argparse
import logging

__all__ = ["run"]


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
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
        default_threshold=args.default_threshold,
        min_choice_mass=args.min_choice_mass,
    )
    app = create_app(
        loader=lambda: Judge.load(
            args.model,
            dtype=args.dtype,
            device=args.device,
            prefix_cache_mb=args.prefix_cache_mb,
        ),
        config=config,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
