"""What an inventory file imports: `from sparkform.inventory import hosts`, which validates every
host the file lists (sparkform.rules.inventory), and what a file needs to refuse a value of its
own the same way (exit_invalid with an InventoryError of Problems: host, field, value, fix)."""

from sparkform.domain.model import InventoryError, Problem
from sparkform.rules.inventory import exit_invalid, hosts

__all__ = ["InventoryError", "Problem", "exit_invalid", "hosts"]
