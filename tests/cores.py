"""How `make test`'s workers share the machine's cores.

`make test` runs the suite in two pytest-xdist workers: most of it runs on one core at a time
(imports, server start-ups, fits, Python), so one worker left the other core idle (117% of a
CPU over a 15-minute run on 2 cores). Two workers whose torch runs two threads each put two
OpenMP teams on two cores, and each slows the other far more than 2x; so each worker's torch,
and every process it starts, gets its share of the cores. The tests that exist for the
threads a user's process runs (a fresh process's first pass, the invariance on every core)
start their process with the user's environment instead (``users_environ``).
"""

from __future__ import annotations

import os

# The environment before any worker changed it, less xdist's own variables: what a user's
# process would start with.
_USERS_ENVIRON = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_share: list[int] = []  # this worker's threads, once share_cores gave it a share


def workers() -> int:
    """How many pytest-xdist workers share this machine (1 outside xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)


def share_cores() -> int | None:
    """In an xdist worker, limit this process's torch and the processes it starts to its share
    of the cores (unless the thread count was set by hand); return that share, or None where
    nothing was changed."""
    if workers() <= 1 or any(name in _USERS_ENVIRON for name in THREAD_VARIABLES):
        return None
    share = max(1, (os.cpu_count() or 1) // workers())
    for name in THREAD_VARIABLES:
        os.environ[name] = str(share)
    import torch  # after the variables, so a first import of torch starts with them too

    torch.set_num_threads(share)
    _share[:] = [share]
    return share


def shared() -> bool:
    """Whether this process runs torch on a share of the cores (``share_cores``)."""
    return bool(_share)


def users_environ(**extra: str) -> dict[str, str]:
    """The environment a user's process starts with (no share of the cores), plus ``extra``."""
    return {**_USERS_ENVIRON, **extra}
