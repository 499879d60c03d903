"""What the agent's socket server and its background passes need of the agent, as interfaces.

service.Agent composes the server (server.py) and the background passes (background.py); they
depend on these interfaces only, not on the service, so each reads alone and none imports back
up (tests/test_layout.py forbids circles inside a package).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol


class HookService(Protocol):
    """What the socket server asks of the agent: run a hook, isolate a task, say whose a process is."""

    log_errors: Callable[[str], None]
    metrics: Any  # agent/metrics.AgentMetrics, or None when [metrics] is off
    public_log: Any  # server.LogLimiter: the public socket's failures, per uid
    background: Any  # background.Background, or None (tests drive the passes themselves)

    def run_hook(self, kind: str, env: Mapping[str, str], still_wanted: Callable[[], bool],
                 defer: Callable[[Callable[[], None]], None] | None = None, requester_pid: int | None = None) -> None: ...

    def isolate(self, pid: int, uid: int, env: Mapping[str, str], public: bool = False) -> str: ...

    def isolation_failed(self, reason: str, pid: int, uid: int) -> str: ...

    def job_of(self, pid: int, uid: int | None = None) -> str | None: ...

    def note_prolog(self, env: Mapping[str, str], started_wall: float, started: float) -> None: ...


class RecordKeeper(Protocol):
    """What the background passes ask of the agent: its config, Slurm's commands, its log."""

    config_path: str
    log_errors: Callable[[str], None]
    metrics: Any
    make_runner: Callable[[float], Callable[[list[str]], str]]

    def has_ended(self, job_id: str) -> bool: ...

    def sweep_isolation(self) -> dict[str, int]: ...

    def sweep_task_records(self) -> int: ...
