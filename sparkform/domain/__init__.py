"""What a host is: types, names, paths, versions; the inventory's schema and its resolved model."""
