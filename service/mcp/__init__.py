"""The Model Context Protocol front (``judge mcp``): the same decisions as ``POST /judge``,
offered to an agent as tools over stdio.

    service.mcp.server    the tools (``judge``, ``decide``, profiles), over the decision core
    service.mcp.command   ``judge mcp``: its flags, the engine and the store, then the server

Imported only when ``judge mcp`` runs: the ``mcp`` extra (``pip install 'calibrated-judge[mcp]'``).
"""
