"""The certificates: thresholds and sets with a guarantee measured on labels a map never
fitted on, and the checks that say when there is none to give.

    certify          the certified confidence threshold (fixed-sequence testing)
    class_certify    a threshold certified per predicted class, all at once
    conformal        split conformal prediction sets over the choices
    cascade_certify  one certificate for a cascade's whole rule
    recertify        certifying again and again from a growing log: one delta over every look
    mass_check       the choice-mass check, chosen from the labels where it helps
    signal           does the judge beat the label prior?
    per_class        how each choice fares, not only the accepted items pooled
"""
