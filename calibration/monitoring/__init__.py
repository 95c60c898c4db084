"""Monitoring and estimates: does a served certificate still hold, has the traffic moved, and
what do a few labels say about a whole dataset?

    health        audits and drift tests on logged decisions
    sequential    tests and intervals valid however often they are looked at
    label_shift   the class mix moving away from the certificate's, its prior re-estimated
    estimates     PPI++ estimates for a dataset from a few labels and the judge's probabilities
    labelling     which items a person should label next: the audit and teach streams
"""
