"""The errors of a rejected weight update (engine/weight_update.py, value_checks.py)."""


class WeightUpdateError(ValueError):
    """A weight update was rejected; the message names the offending tensor. Nothing was written."""


class WeightVersionError(WeightUpdateError):
    """The update's version does not come after the one serving. Nothing was written."""
