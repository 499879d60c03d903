"""slurm-mapa: topology-aware GPU allocation for Slurm (MAPA, SC21)."""

__version__ = "0.1.0"

#: The Slurm releases this version is tested with, newest first: the mini clusters of
#: tests/cluster/conftest.py (RELEASE_CLUSTERS) run these, and tests/test_packaging.py checks that
#: the two lists agree. `mapa --version` and `mapa-replay --version` print them.
TESTED_SLURM_RELEASES: tuple[str, ...] = ("26.05", "24.11")


def version_text(prog: str) -> str:
    """``mapa 0.1.0 (tested with Slurm 26.05, 24.11)``: what ``--version`` prints."""
    return f"{prog} {__version__} (tested with Slurm {', '.join(TESTED_SLURM_RELEASES)})"
