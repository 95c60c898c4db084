"""The HTTP service, whole: a request's path from the front door to the response.

    app          ``create_app(engine)``: the Litestar app, its lifespan and middleware
    frontdoor    what every request passes before routing (API key, admission, timeouts)
    operations   the table of operations that routes, OpenAPI, metrics and the client share
    routes       the endpoints, thin, registered from the table
    bodies       request bodies decoded strictly, or refused by name
    openapi      the OpenAPI document, derived from the table
    serving      the ``Service`` the endpoints call, cut by family:
      serving_core, serving_judge, serving_systemone, serving_profiles, serving_feedback
    batcher      model work on one thread, fair between requests
    playground   the page to try the judge by hand (``static/``)
    ray_serve    the same app as Ray Serve replicas

What a route shares with the MCP server and the command line (the gate's context, the wire
types, the profile store, the config, errors and metrics) is in ``service`` itself; the
cascade's stages are in ``service.cascade`` and the decision log in ``service.log``.
"""
