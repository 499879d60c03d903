"""The Slurm layer: the #MAPA directive grammar, hooks, the node ledger and thin Slurm adapters."""
