"""The ``judge`` command line (console script ``judge = service.cli.main:main``).

    service.cli.main            the parser (each command module adds its own) and ``main(argv)``
    service.cli.ask             ``judge ask``: one prompt, or a JSONL file of them (batch gating)
    service.cli.ask_cascade     ``judge ask --cascade``: what the first model escalates, to the next
    service.cli.calibrate       ``judge calibrate`` and ``judge evaluate`` on labeled tasks
    service.cli.profile_files   a fitted profile's files: the profile, its report, its diagram
    service.cli.decide          ``judge decide``: typed questions about a state
    service.cli.log             ``judge label``, ``check``, ``replay``, ``calibrate --from-log``
    service.cli.label_queue     ``judge label --queue``: the log's decisions or a file's items
    service.cli.estimate        ``judge estimate``: a dataset's shares and the judge's accuracy
    service.cli.qualify         ``judge qualify``: a fixed suite before a model is a stage

``judge serve`` and ``judge mcp`` start the other two fronts: their commands live with them
(``service.web.command``, ``service.mcp.command``), and ``service.command_line`` has what every
command shares. ``service.cli.main`` is the ``judge`` program: it lists every front's commands.

Each command module has ``add_arguments(commands)``, which adds its commands and the
function that runs each; none imports torch, transformers or Litestar at the top, so
``judge --help`` works on the client's install.

The top of the stack: it imports ``judge``, ``calibration`` (with ``calibration.tasks``) and
``service``, and nothing imports it. ``python -m service.cli`` runs the same command line.
"""
