"""A cascade's later stages, behind every route that decides (``judge serve --cascade``).

    stages             the stages judge speaks: a model in this process (``LocalStage``), another
                       judge server (``RemoteStage``); each asked a judgment or a typed question
    escalation         the one escalation: what the first stage escalated, to each later stage in
                       turn, for judgments and typed questions alike (``escalated``)
    system_one_stage   any System One server as a stage (``SystemOneStage``)

Imported only where a cascade is configured: a server without one never loads this package.
The server's side (stages loaded at start-up, run off its event loop, counted in its metrics)
is ``service.web.serving_cascade``.
"""
