"""A cascade's later stages, behind every route that decides (``judge serve --cascade``).

    stages             the stages judge speaks: a model in this process (``LocalStage``), another
                       judge server (``RemoteStage``); each asked a judgment or a typed question
    escalation         the one escalation: what the first stage escalated, to each later stage in
                       turn, for judgments and typed questions alike (``escalated``)
    system_one_stage   any System One server as a stage (``SystemOneStage``)

``judge serve`` and the command line import it only where a cascade is configured: an HTTP
server without one neither loads nor calls it (``tests/test_structure.py`` traces one). The
MCP server imports it at the top of ``service.mcp.server``, so ``judge mcp`` loads it with or
without a cascade (without one it opens no stage). The HTTP server's side (stages loaded at
start-up, run off its event loop, counted in its metrics) is ``service.web.serving_cascade``.
"""
