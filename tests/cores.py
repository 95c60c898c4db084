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
from pathlib import Path

# The environment before any worker changed it, less xdist's own variables: what a user's
# process would start with.
_USERS_ENVIRON = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def workers() -> int:
    """How many pytest-xdist workers share this machine (1 outside xdist)."""
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)


def shared() -> bool:
    """Whether this process runs torch on a share of the cores (``share_cores``): in an xdist
    worker, unless the thread count was set by hand."""
    return workers() > 1 and not any(name in _USERS_ENVIRON for name in THREAD_VARIABLES)


def share_cores() -> None:
    """Where ``shared``, limit this process's torch and the processes it starts to its share
    of the cores."""
    if not shared():
        return
    share = max(1, (os.cpu_count() or 1) // workers())
    for name in THREAD_VARIABLES:
        os.environ[name] = str(share)  # for the processes it starts
    import torch  # this process's own torch may be running already: its threads are set here

    torch.set_num_threads(share)


def users_environ(**extra: str) -> dict[str, str]:
    """The environment a user's process starts with (no share of the cores), plus ``extra``."""
    return {**_USERS_ENVIRON, **extra}


def cpu_flags() -> set[str]:
    """Every flag on the "flags" lines of /proc/cpuinfo (none where it cannot be read), read
    independently of the loader's own check."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return {
        flag
        for line in lines
        if line.split(":", 1)[0].strip() == "flags"
        for flag in line.split(":", 1)[1].split()
    }
