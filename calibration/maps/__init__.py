"""The maps: fitted functions from a judgment's scores (and hidden states) to calibrated
probabilities, and their fitters.

    map_types    the maps a profile carries, as typed data (Identity, Temperature,
                 BiasTemperature, Probe) and how each applies
    scaling      temperature and bias scaling, fitted by cross-validated likelihood
    probe        a learned head on the pass's own hidden states
    label_free   prior correction without labels: contextual and batch calibration
"""
