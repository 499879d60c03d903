"""Pure allocation core: hardware graphs, patterns, scores, the exact search and the policies.

Nothing in this package does I/O or knows about Slurm; the replay, the Prolog and the CLI
all call the same functions.
"""
