"""Loading an inventory and every rule over a whole host: validation, the memory plan, the boot chain."""
