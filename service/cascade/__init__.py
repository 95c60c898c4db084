"""A cascade's later stages, behind every route that decides (``judge serve --cascade``).

    cascade_judgments   a judgment's cascade: what its first stage escalates goes on to each
                        later stage, local or remote (the server's and ``judge ask``'s)
    cascade_questions   typed questions and pairs: the same question, local or remote
    remote_stage        stages on other servers (a judge server, a System One server)

Imported only where a cascade is configured: a server without one never loads this package.
The server's side (stages loaded at start-up, run off its event loop, counted in its metrics)
is ``service.web.serving_cascade``.
"""
