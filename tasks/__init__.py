"""pyinfra tasks: thin adapters from a validated host (sparkform.validate.Host) to operations."""
