"""The logic behind `shardflow plan` and `shardflow scale`: units, the step model, calibration, scaling runs."""
