"""The decision log and what reads it.

decision_log      the append-only log of every decision, whatever its database: the
                  interface (``DecisionLog``), the table, retention, labels and errors
record            one logged decision (``LoggedDecision``), a cascade's outcome kept with
                  it, and what ``judge replay`` re-runs
backends          the two databases, SQLite and PostgreSQL, and ``open_log``
logged_features   a decision's hidden states kept in the log, so a probe can be refitted
health            is a profile still keeping its promise? its health from the log
health_history    a version's health at points of its decisions, for the Traffic chart
shift_watch       holds a version whose traffic's class mix moved, until re-certified
labelling_queue   the next decision to label: the audit and teach streams, kept apart
refit             a profile's next version from its log's labels
adapter_refit     an adapter profile's adapter retrained on its log's items
"""
