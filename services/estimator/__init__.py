"""EstimatorService: the configuration map of profiled models (issue 4)."""
