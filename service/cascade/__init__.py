"""A cascade's later stages, behind every route that decides (``judge serve --cascade``).

    serving_cascade     the stages a server runs: what its first stage escalates goes on
    cascade_questions   typed questions and pairs: the same question, local or remote
    remote_stage        stages on other servers (a judge server, a System One server)

Imported only where a cascade is configured: a server without one never loads this package.
"""
