"""What a host prints, read back and checked against a pattern before use."""
