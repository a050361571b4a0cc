"""What the commands show: status, the KV ledger, the contract, the bench."""
