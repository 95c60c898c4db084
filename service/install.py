"""How to install the part of the project a command needs: one spelling for every message.

The distribution is ``calibrated-judge``. The name ``judge`` on the package index belongs to an
unrelated project (a 2016 package that chooses values from a tree of conditions), so ``pip
install judge`` installs that, never this; the import packages (``judge``, ``calibration``,
``service``) and the ``judge`` command keep their names. The base install is the Python client;
each extra adds what a front needs (``server``: the engine, the fitters, the HTTP service).
"""

from __future__ import annotations

__all__ = ["DISTRIBUTION", "install_hint", "missing_adapter_extra"]

DISTRIBUTION = "calibrated-judge"


def install_hint(extra: str | None = None) -> str:
    """The command that installs ``extra`` (None: the client alone), from the index and from a
    checkout of the repository."""
    if extra is None:
        return f"pip install {DISTRIBUTION} (from a checkout: pip install .)"
    return f"pip install '{DISTRIBUTION}[{extra}]' (from a checkout: pip install '.[{extra}]')"


def missing_adapter_extra() -> str | None:
    """What to say, before any work, where an adapter is to be trained and peft (the
    ``adapter`` extra) is not installed; None where it is."""
    from calibration.tasks.adapter.training import PEFT_MISSING, require_peft

    try:
        require_peft()
    except ModuleNotFoundError:
        return f"{PEFT_MISSING}: {install_hint('adapter')}"
    return None
