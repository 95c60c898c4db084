"""The ``judge`` command line (console script ``judge = service.cli.main:main``).

    service.cli.main        the parser (each command module adds its own) and ``main(argv)``
    service.cli.ask         ``judge ask``: one prompt, or a JSONL file of them (batch gating)
    service.cli.calibrate   ``judge calibrate`` and ``judge evaluate`` on labeled tasks
    service.cli.serve       ``judge serve``: the HTTP service (its settings' flags come from
                            ``service.config.ServiceConfig``)
    service.cli.decide      ``judge decide``: typed questions about a state
    service.cli.log         ``judge label``, ``check``, ``replay``, ``calibrate --from-log``
    service.cli.serve_mcp   ``judge mcp``: the MCP server (service.mcp_server) over stdio
    service.cli.common      what the commands share

Each command module has ``add_arguments(commands)``, which adds its commands and the
function that runs each; none imports torch, transformers or Litestar at the top, so
``judge --help`` works on the client's install.

The top of the stack: it imports ``judge``, ``calibration`` (with ``calibration.tasks``) and
``service``, and nothing imports it. ``python -m service.cli`` runs the same command line.
"""
