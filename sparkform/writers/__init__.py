"""What lands on a host: rendered files, the host programs' settings, the converge plan."""
