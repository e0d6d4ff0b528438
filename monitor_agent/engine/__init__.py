"""The PyTorch engine: one decoder implementation driven by an ArchSpec, behind Engine."""
