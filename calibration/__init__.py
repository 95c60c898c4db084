"""Calibration of choice probabilities (temperature scaling, metrics, routing thresholds).

Works on arrays of scores and labels; depends on neither the engine nor the service.
"""

__all__: list[str] = []
