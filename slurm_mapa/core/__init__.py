"""Pure allocation core: hardware graphs, patterns, scores, the exact search and the policies.

Nothing in this package does I/O or knows about Slurm; the replay, the Prolog and the CLI
all call the same functions.

Its modules import one another without a cycle and nothing from slurm_mapa.slurm, .replay or
.hardware (tests/core/test_core_imports.py); each module's docstring says what it owns and imports.
"""
