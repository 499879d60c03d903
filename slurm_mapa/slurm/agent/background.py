"""mapa-agent's background work, off the jobs' start path: reconcile passes, node features, the
journal's AdminComment records, dcgm-exporter's job mapping (after starts and ends, and every
``reconcile_interval``)."""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING, Callable

from ..config import hook_logger, load_hook_config

if TYPE_CHECKING:
    from .roles import RecordKeeper

MAX_RECORD_AGE_S = 7 * 86400  # a record slurmctld has refused for a week is dropped (and logged)
MAX_BACKOFF_S = 300.0
MIN_RECONCILE_GAP_S = 1.0
GATHER_S = 0.25  # after a start or an end, the records loop waits this long for the next ones
# After starts and ends, slurmctld is asked to update the node's features at most once per this
# long: each update is a node update in slurmctld, and under a burst of short jobs publishing the
# features added 0.5-0.7 s to the median start, before the allocation (40 jobs on 5 nodes;
# docs/benchmarks.md). The next turn of the records loop (within a second) publishes what changed.
FEATURES_MIN_GAP_S = 1.0
# While a held GPU waits for a free GPU to reserve (hooks/held_in_slurm.py), the records loop tries
# again after starts and ends, at most once per this long (each try is two or three scontrol calls).
HELD_RETRY_GAP_S = 2.0
HELD_RETRY_WINDOW_S = 15.0  # ... for this long after each start or end (the next reconcile pass tries anyway)


class Background:
    """mapa-agent's work off the job-start path, in two threads: reconcile passes (one squeue
    listing per ``reconcile_interval``, with jitter, so that the nodes of a cluster do not ask at
    once), and after starts and ends the node's features (``[features]``, when they changed) and
    the journal's AdminComment records (at most ``admin_comment_rate`` per second, retried with
    back-off while slurmctld does not answer)."""

    def __init__(self, agent: "RecordKeeper", node: str, clock: Callable[[], float] = time.monotonic) -> None:
        from .features import Publisher

        self.agent = agent
        self.node = node
        self.clock = clock
        self.wake = threading.Event()
        self.stop = threading.Event()
        # Set when a task of a job unknown here asks for isolation (its Prolog never marked it):
        # the next reconcile pass (which adopts it) runs now, not at its interval.
        self.reconcile_soon = threading.Event()
        self.retry_at: dict[str, float] = {}
        self.failures: dict[str, int] = {}
        self.features = Publisher(node)
        self.features_asked_at: float | None = None  # when publish_features last asked slurmctld (self.clock)
        from .dcgm import MappingWriter

        self.dcgm_writer = MappingWriter()  # says each problem of the mapping directory once, not every second
        # Held GPUs told to slurmctld (hooks/held_in_slurm.py): whether Slurm may have something of
        # MAPA's for them (then every pass checks), the held-GPUs file's mtime at the last check (a
        # change is checked even with nothing held), whether to try again after the next end (a
        # held GPU Slurm could not reserve while jobs used every GPU), and the problems said last.
        self.held_in_slurm = False
        self.held_stamp: int | None = None
        self.held_retry = False
        self.held_asked_at: float | None = None
        self.held_problems: list[str] = []
        self.held_lock = threading.Lock()  # the health thread tells Slurm too (after a hold or release)
        from .health import HealthMonitor

        self.health = HealthMonitor()
        self.health_said = ""  # the sources' summary last logged

    def _config(self):
        config, problem = load_hook_config({"MAPA_CONFIG": self.agent.config_path}, validate=False)
        return config

    def reconcile_once(self) -> bool:
        from ..hooks.reconcile import reconcile_node

        config = self._config()
        run = self.agent.make_runner(config.command_timeout)
        log = hook_logger(config.log)
        metrics = self.agent.metrics
        listed = reconcile_node(config, self.node, run, metrics.repair_log(log) if metrics is not None else log)
        if self.features.publish(config, run, log, force=True) and metrics is not None:  # slurmctld may have restarted
            metrics.feature_published()
        try:
            self.tell_slurm_held(config, force=True)  # slurmctld may have restarted, or someone deleted a reservation
        except Exception as error:  # noqa: BLE001 - the next pass tries again
            self.agent.log_errors(f"mapa-agent: telling Slurm of the held GPUs failed: {error}")
        return listed

    def tell_slurm_held(self, config=None, force: bool = False):
        with self.held_lock:
            return self._tell_slurm_held(config, force)

    def _tell_slurm_held(self, config=None, force: bool = False):
        """Make slurmctld's view of the held GPUs match the held-GPUs file (hooks/held_in_slurm.py):
        at every reconcile pass while anything is held or was (``force``), and after starts and
        ends while a held GPU waits for Slurm to have one free to reserve (at most every
        HELD_RETRY_GAP_S). Asks slurmctld nothing on a node where no GPU was ever held. What it
        did (None: nothing asked)."""
        from ..hooks.held_in_slurm import tell_slurm
        from ..hooks.node_graph import load_graph
        from ..node_state import HeldCorrupt, NodeState

        if not force and (not self.held_retry or (self.held_asked_at is not None
                                                   and self.clock() - self.held_asked_at < HELD_RETRY_GAP_S)):
            return None
        config = config or self._config()
        state = NodeState.of(config)
        try:
            stamp: int | None = state.held_path().stat().st_mtime_ns
        except OSError:
            stamp = None
        if not self.held_in_slurm and (stamp is None or stamp == self.held_stamp):
            return None
        log = hook_logger(config.log)
        try:
            holds = state.held_gpus()
        except (HeldCorrupt, OSError) as error:  # the hooks hold nothing out; Slurm keeps what it had until it is fixed
            self._say_held_problems(log, [f"cannot read the held GPUs ({error}); Slurm's reservations are left as they are"])
            return None
        self.held_asked_at = self.clock()
        told = tell_slurm(config, self.node, load_graph(config, self.node).size,
                          {gpu: hold.reason for gpu, hold in holds.items()}, self.agent.make_runner(config.command_timeout))
        self.held_in_slurm = bool(holds) or not told.complete
        self.held_stamp = stamp
        self.held_retry = bool(told.unreserved)
        for line in told.changes(self.node):
            log(f"mapa-agent: {line}")
        self._say_held_problems(log, told.problems)
        return told

    def health_pass(self, config=None) -> list[str]:
        """Read the GPUs' health (health.py) and hold or release what the sources found; tell
        slurmctld at once when anything changed. What changed."""
        from ..hooks.node_graph import load_graph
        from ..node_state import NodeState

        config = config or self._config()
        if config.health == "off":  # nothing read, nothing said (the sources' NVML session is closed)
            self.health.health_pass(None, 0, off=True)
            self.health_said = ""
            return []
        log = hook_logger(config.log)
        lines = self.health.health_pass(NodeState.of(config), load_graph(config, self.node).size)
        summary = self.health.summary()
        if summary != self.health_said:
            log(f"mapa-agent: GPU health: {summary}")
            self.health_said = summary
        for line in lines:
            log(f"mapa-agent: {line}")
        if lines:
            self.tell_slurm_held(config, force=True)
        return lines

    def _say_held_problems(self, log, problems: list[str]) -> None:
        """Log the problems of telling Slurm when they change (not at every pass while they last)."""
        if problems != self.held_problems:
            for problem in problems:
                log(f"mapa-agent: held GPUs not told to Slurm: {problem}")
            if not problems:
                log("mapa-agent: held GPUs told to Slurm again")
        self.held_problems = list(problems)

    def publish_features(self, config=None) -> bool:
        """After starts and ends: publish the node's features if they changed, at most once per
        FEATURES_MIN_GAP_S (a later turn publishes what changed meanwhile)."""
        if self.features_asked_at is not None and self.clock() - self.features_asked_at < FEATURES_MIN_GAP_S:
            return False
        config = config or self._config()
        published = self.features.publish(config, self.agent.make_runner(config.command_timeout), hook_logger(config.log))
        if published:
            self.features_asked_at = self.clock()
            if self.agent.metrics is not None:
                self.agent.metrics.feature_published()
        return published

    def write_dcgm_mapping(self, config=None) -> list[str]:
        """With ``dcgm_job_mapping_dir``: name in dcgm-exporter's job-mapping files the jobs using
        each GPU as the jobs directory says (MAPA's GPUs, else Slurm's for a job MAPA did not
        place); what changed. Each turn of the records loop (at once after a start or an end, else
        every second), so jobs a reconcile pass reaped drop out too; unchanged files stay as they are."""
        from . import dcgm
        from ..hooks.node_graph import load_graph
        from ..node_state import NodeState

        config = config or self._config()
        if config.dcgm_job_mapping_dir is None:
            self.dcgm_writer.forget()
            return []
        holdings = NodeState.of(config).gpus_in_use()
        gpu_count = load_graph(config, self.node).size
        result = self.dcgm_writer.write(config.dcgm_job_mapping_dir, dcgm.mapping_files(holdings, gpu_count))
        for line in result.log_lines():  # new problems, and "solved: ..." when one goes away
            self.agent.log_errors(f"mapa-agent: DCGM job mapping: {line}")
        return list(result.changed)

    def flush_records(self, config=None) -> int:
        """Write the journal's due records; how many were written or dropped."""
        from ..hooks.admin_comment import flush_entry, flush_note
        from ..node_state import NodeState
        from ..text.commands import reading_jobs_at_once

        config = config or self._config()
        log = hook_logger(config.log)
        run = self.agent.make_runner(config.command_timeout)
        finished = 0
        state = NodeState.of(config)
        pending = state.pending_records()
        names = {name for name, _, _ in pending}
        # The jobs of this turn's writes (about a second of them at admin_comment_rate), read at once.
        due = [state.job_of_record(name) or name for name, _, _ in pending
               if self.retry_at.get(name, 0.0) <= self.clock() and not self.agent.has_ended(state.job_of_record(name) or name)]
        run = reading_jobs_at_once(run, config.squeue, config.scontrol, due[:max(1, int(config.admin_comment_rate))])
        merged: set[str] = set()
        for name, _, mtime in pending:
            if self.stop.is_set():
                break
            if name in merged or self.retry_at.get(name, 0.0) > self.clock():
                continue
            job_id = state.job_of_record(name) or name
            entry = state.take_record(name)
            if entry is None:
                continue
            started = self.clock()
            note_name = state.note_of_record(name)
            note = state.take_record(note_name) if not state.is_note(name) and note_name in names else None
            if mtime and time.time() - mtime > MAX_RECORD_AGE_S:
                log(f"job {job_id}: its AdminComment record could not be written for a week; dropped: {entry.record}")
                done = True
            elif self.agent.has_ended(job_id):
                # slurmctld refuses an AdminComment update once the job has finished: not asked.
                log(f"job {job_id}: ended before its AdminComment record was written; the "
                    f"{'isolation note' if state.is_note(name) else 'decision'} stays in this node's log only")
                done = True
            elif note is not None:
                # The decision and its isolation note, both still to write: one read and one update
                # of the AdminComment instead of two each (a burst of short jobs: docs/benchmarks.md).
                done = flush_entry(config, job_id, entry, run, log, note=note)
            else:
                done = (flush_note if state.is_note(name) else flush_entry)(config, job_id, entry, run, log)
            if note is not None:
                state.finish_record(note_name, done)
                merged.add(note_name)
                finished += done
            state.finish_record(name, done)
            if done:
                finished += 1
                self.retry_at.pop(name, None)
                self.failures.pop(name, None)
            else:
                failures = self.failures[name] = self.failures.get(name, 0) + 1
                self.retry_at[name] = self.clock() + min(MAX_BACKOFF_S, 2.0 ** failures) * random.uniform(0.8, 1.2)
            pause = 1.0 / config.admin_comment_rate - (self.clock() - started)
            if pause > 0:
                self.stop.wait(pause)
        return finished

    def _reconcile_loop(self) -> None:
        while not self.stop.is_set():
            self.reconcile_soon.clear()
            try:
                self.reconcile_once()
                interval = self._config().reconcile_interval
            except Exception as error:  # noqa: BLE001 - the next pass tries again
                self.agent.log_errors(f"mapa-agent: reconcile pass failed: {error}")
                interval = 60.0
            try:
                # Tasks that started while no agent answered (the first pass runs at the agent's start).
                self.agent.sweep_isolation()
            except Exception as error:  # noqa: BLE001 - the next pass tries again
                self.agent.log_errors(f"mapa-agent: isolation sweep failed: {error}")
            try:
                # The SPANK plugin's task records whose process is gone (a job whose Epilog ran
                # while no agent did, a task killed before its job ended).
                self.agent.sweep_task_records()
            except Exception as error:  # noqa: BLE001 - the next pass tries again
                self.agent.log_errors(f"mapa-agent: removing the records of ended tasks failed: {error}")
            self.stop.wait(MIN_RECONCILE_GAP_S)  # however often tasks ask: one squeue a second at most
            self.reconcile_soon.wait(interval * random.uniform(0.75, 1.25))

    def _records_loop(self) -> None:
        from ..node_state import NodeState

        try:
            NodeState.of(self._config()).recover_records()
        except Exception as error:  # noqa: BLE001
            self.agent.log_errors(f"mapa-agent: could not recover the journal: {error}")
        last_woken: float | None = None
        while not self.stop.is_set():
            woken = self.wake.wait(1.0)
            if woken:
                # A start or an end: the next moment's starts and ends go into the same turn (a
                # burst's records are then read together and its features published once).
                self.stop.wait(GATHER_S)
            self.wake.clear()
            config = self._config()  # once per turn, for its three parts (it is read every second)
            try:
                self.publish_features(config)  # first: it steers where the next jobs go
            except Exception as error:  # noqa: BLE001 - the next change or pass publishes again
                self.agent.log_errors(f"mapa-agent: publishing node features failed: {error}")
            if woken:
                last_woken = self.clock()
            try:
                if last_woken is not None and self.clock() - last_woken < HELD_RETRY_WINDOW_S:
                    # A held GPU Slurm could not reserve: a job's end frees GPUs once its Epilog is done.
                    self.tell_slurm_held(config)
            except Exception as error:  # noqa: BLE001 - the next pass tries again
                self.agent.log_errors(f"mapa-agent: telling Slurm of the held GPUs failed: {error}")
            try:
                self.write_dcgm_mapping(config)
            except Exception as error:  # noqa: BLE001 - the next turn writes it again
                self.agent.log_errors(f"mapa-agent: writing the DCGM job mapping failed: {error}")
            try:
                self.flush_records(config)
            except Exception as error:  # noqa: BLE001 - the records stay in the journal
                self.agent.log_errors(f"mapa-agent: writing AdminComment records failed: {error}")

    def _health_loop(self) -> None:
        from .health import HEALTH_INTERVAL_S

        while not self.stop.is_set():
            try:
                self.health_pass()
            except Exception as error:  # noqa: BLE001 - the next pass tries again
                self.agent.log_errors(f"mapa-agent: GPU health pass failed: {error}")
            self.stop.wait(HEALTH_INTERVAL_S)
        self.health.close()

    def start(self) -> None:
        for target in (self._reconcile_loop, self._records_loop, self._health_loop):
            threading.Thread(target=target, daemon=True, name=f"mapa-agent {target.__name__}").start()


