"""The project's error classes. Messages say what was received and what is accepted."""


class MapaError(Exception):
    """Base class of every error this project raises on purpose."""


class InputError(MapaError, ValueError):
    """Bad user or admin input (a directive, a topology file, a command-line value)."""


class InternalError(MapaError, RuntimeError):
    """A broken internal invariant: a bug in slurm-mapa, never the user's fault."""
