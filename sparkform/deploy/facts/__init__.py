"""pyinfra facts sparkform reads from a DGX Spark."""
