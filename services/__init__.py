"""iserve's shared kernel: settings, Redis state, gRPC bootstrap, estimation maths, CLI."""
