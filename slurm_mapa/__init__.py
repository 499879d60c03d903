"""slurm-mapa: topology-aware GPU allocation for Slurm (MAPA, SC21)."""

__version__ = "0.1.0"
