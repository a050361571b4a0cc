"""pyinfra operations, one module per concern: thin over a validated host (sparkform.domain.model.Host)."""
