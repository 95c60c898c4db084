"""Adapters that learn: a profile whose probe reads a layer under low-rank adapters trained
on its fit split (``judge calibrate --method adapter``).

    fit        fit and certify an adapter profile on a task's labelled items
               (``AdapterProfile``, ``fit_adapter_profile``)
    training   train the adapters under the probe's head (``AdapterSettings``,
               ``fit_adapter``): torch and peft, imported only when it runs

Training needs the ``adapter`` extra (peft); ``training`` is the one module that imports it.
The engine and the gate see only what a profile carries (``judge.adapters.Adapter``, merged by
the engine), never this folder; a profile's adapter is retrained from the decision log by
``service.log.adapter_refit``, through ``fit_adapter_profile``.
"""

from calibration.tasks.adapter.fit import AdapterProfile, fit_adapter_profile

__all__ = ["AdapterProfile", "fit_adapter_profile"]
