"""DeploymentService: configuration -> devices -> layer map -> workers."""
