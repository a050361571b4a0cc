"""pyinfra tasks: thin adapters from a validated host (sparkform.model.Host) to operations."""
