"""The HTTP service, whole: a request's path from the front door to the response.

    command             ``judge serve``: its flags, then the engine loaded in the background
    app                 ``create_app(engine)``: the Litestar app, its lifespan and middleware
    frontdoor           what every request passes before routing (API key, admission, timeouts)
    routes              the endpoints, thin, registered from the table of operations
    openapi             the OpenAPI document, derived from the same table
    serving             the ``Service`` the endpoints call, cut by operation family:
    serving_core        what every family shares: start-up, the batcher, the store, the log
    serving_judge       ``POST /judge`` and ``POST /judge/batch``
    serving_cascade     a cascade's later stages, loaded only with ``--cascade``
    serving_systemone   ``POST /v1/systemone``: typed questions about one state
    serving_profiles    ``/profiles``: list, store and fit profiles
    serving_feedback    the decision log's endpoints: decisions, labels, profiles' health
    background_refit    a profile refitted from the log once enough new labels arrive
    batcher             model work on one thread, fair between requests
    playground          the page to try the judge by hand (``static/``)
    ray_serve           the same app as Ray Serve replicas

What a route shares with the MCP server and the command line (the gate's context, the wire
types, the table of operations, request bodies, the profile store, the config, errors and
metrics) is in ``service`` itself; the cascade's stages are in ``service.cascade`` and the
decision log in ``service.log``.
"""
