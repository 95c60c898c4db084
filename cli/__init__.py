"""The ``judge`` command line (console script ``judge = cli.main:main``).

    cli.main        the argument parser and ``main(argv)``
    cli.ask         ``judge ask``: one prompt, or a JSONL file of them (batch gating)
    cli.calibrate   ``judge calibrate`` and ``judge evaluate`` on labeled tasks
    cli.serve       ``judge serve``: the HTTP service
    cli.common      what the commands share

The top of the stack: it imports ``judge``, ``calibration``, ``tasks`` and ``service``, and
nothing imports it. ``python -m cli`` runs the same command line.
"""
