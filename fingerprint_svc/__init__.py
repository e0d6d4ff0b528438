"""ModelService: registers checkpoints (and, later, cuts and profiles fingerprints)."""
