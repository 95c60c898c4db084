"""The HTTP service over the judge engine."""

__all__: list[str] = []
