"""The decision log and what reads it.

decision_log      the append-only log of every decision (SQLite, PostgreSQL)
logged_features   a decision's hidden states kept in the log, so a probe can be refitted
health            is a profile still keeping its promise? its health from the log
"""
