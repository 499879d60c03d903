"""Device isolation owned by MAPA: a job's processes can open only the GPUs MAPA chose for it.

Slurm's own device constraint (cgroup.conf ``ConstrainDevices=yes``) denies the GPUs *Slurm*
picked against, which are not the ones MAPA exports, so MAPA nodes run ``ConstrainDevices=no``
and the node's mapa-agent applies the same kind of rule for MAPA's choice (docs/isolation.md):

* The TaskProlog (the job's user, in a child of the task process before it execs) asks the agent
  over a socket anyone may connect to. The agent believes nothing the request says about which
  job it is: it takes the caller's pid from the socket (SO_PEERCRED), walks up to the task
  process (a forked slurmstepd owned by the caller's uid) and reads the job and step from that
  process's /proc/PID/cgroup, which the kernel writes and Slurm's cgroup plugin chose.
* cgroup v1: the task process is moved into ``<devices>/mapa/job_J`` (and ``.../step_S`` for a
  step using fewer GPUs than the job) whose rules deny the other GPUs; its children inherit it.
* cgroup v2 (no devices controller): a BPF_PROG_TYPE_CGROUP_DEVICE program, built here as bytes,
  is attached with BPF_F_ALLOW_MULTI to Slurm's ``job_J`` cgroup (every process of the job,
  whichever step) and, for a smaller step, to its ``step_S/user`` cgroup.

Like Slurm's rules (src/plugins/task/cgroup/task_cgroup_devices.c), these deny GPU device files
and allow everything else: a whitelist would also have to know InfiniBand's /dev/infiniband/*,
/dev/fuse, gdrcopy and every other device a job may need. Denied: NVIDIA ``c 195:0-253`` but the
job's GPUs (254 is nvidia-modeset, 255 nvidiactl; nvidia-uvm and /dev/nvidia-caps have majors of
their own and stay allowed), AMD ``c 226:128-255`` but the job's render nodes (amdkfd checks the
device cgroup against each GPU's render node, so /dev/kfd needs no rule). The whole range is
denied, not only the files that exist, because nvidia-modprobe (setuid) creates missing
/dev/nvidiaN files on demand.

This module is what the agent runs for a TaskProlog (Isolator) and which mode a node applies.
The pure parts (reading /proc/PID/cgroup, /proc/PID/status and /proc/self/mountinfo text, the
deny rules and v1's lines for them) are rules.py; the v2 program, bpf.py; the
I/O edges, which take the root of each file system (/proc, the devices hierarchy, the cgroup2
mount) so tests run them on a temporary directory, cgroups.py.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from ...errors import MapaError
from .bpf import attach_device_program
from .cgroups import (apply_v1, apply_v2, find_task_process, read_mounts, read_proc_cgroup, read_process,
                      slurm_cgroup_of, slurmstepd_binary_problem, v1_directories, v1_minors_allowed_in)
from .rules import (RENDER_MINORS, IsolationError, ProcessInfo, SlurmCgroup, device_rules, devices_cgroup_path, devices_root,
                    gpus_of_step, is_numbered_step, mapa_job_cgroup_level, mount_points)


@dataclass(frozen=True)
class Outcome:
    """What an isolate request came to: ``state`` is cgroup-v1, cgroup-v2, off or failed-open."""

    state: str
    job_id: str
    step: str
    detail: str
    gpus: tuple[int, ...] = ()  # what the task may open now (the detail's ``gpus=``)


@dataclass(frozen=True)
class JobDevices:
    vendor: str
    job_gpus: tuple[int, ...]
    minors: Callable[[int], int]
    mapping: "object | None" = None  # node_state.JobMapping: Slurm's GPUs paired with MAPA's


class Isolator:
    """Applies isolation for TaskProlog requests; one per agent (it remembers which cgroups it
    configured, and runs one request at a time: the writes are fast, and serialising them keeps
    two tasks of a job from configuring its cgroup at once)."""

    def __init__(self, proc: Path = Path("/proc"), mountinfo: Path = Path("/proc/self/mountinfo"),
                 attach: Callable[[Path, bytes], None] = attach_device_program,
                 binary_problem: Callable[[Path], str | None] = slurmstepd_binary_problem) -> None:
        self.proc = proc
        self.mountinfo = mountinfo
        self.attach = attach
        self.binary_problem = binary_problem  # tests' fake /proc links to a slurmstepd this host lacks
        self.lock = threading.Lock()
        self.configured: set[tuple[str, int]] = set()  # cgroups written or attached to
        # (job, step) -> the step's GPUs, as the SPANK plugin's request (root, before Slurm narrows
        # the environment to each task) said: a TaskProlog's request then knows the whole step's.
        self.steps: dict[tuple[str, str], tuple[int, ...]] = {}
        # (job, step, task) -> the GPUs a v1 task cgroup was configured with (isolation_scope = "task")
        self.tasks: dict[tuple[str, str, str], tuple[int, ...]] = {}

    def isolate(self, peer_pid: int, peer_uid: int, request: Mapping[str, str],
                job_devices: Callable[[str], JobDevices], scope: str = "step",
                job_of_sluid: Callable[[str], str | None] = lambda sluid: None) -> Outcome:
        """Isolate the task of the TaskProlog (or SPANK plugin, uid 0) ``peer_pid``; IsolationError
        says why it could not. ``job_devices``: the job's GPUs and their device numbers, for a job
        id. ``scope``: "step" (every task of a step opens all of the step's GPUs, as CUDA/ROCm IPC
        between ranks needs) or "task" (each task its own, from its TaskProlog's request)."""
        all_mounts = read_mounts(self.mountinfo)
        task, cgroup = find_task_process(self.proc, peer_pid, peer_uid, all_mounts, self.binary_problem)
        if peer_uid != 0 and cgroup.uid is not None and cgroup.uid != peer_uid:
            raise IsolationError(f"task {task.pid} of uid {peer_uid} is in {cgroup.path!r}, a cgroup of uid {cgroup.uid}'s jobs")
        mounts = mount_points(all_mounts)
        if cgroup.sluid:  # Slurm 26.05: the kernel names the job by its SLUID; the Prolog's mark maps it
            job_id = job_of_sluid(cgroup.sluid)
            if job_id is None:
                raise IsolationError(f"no Prolog mark here names SLUID {cgroup.sluid}, the job of task {task.pid} "
                                     "(its Prolog did not run on this node, or Slurm gave it no SLURM_JOB_SLUID)")
            cgroup = dataclasses.replace(cgroup, job_id=job_id)
        try:
            return self._isolate_task(task, cgroup, request, job_devices, mounts, scope, from_root=peer_uid == 0,
                                      mounted_root=devices_root(all_mounts))
        except IsolationError as error:
            error.job_id = cgroup.job_id  # known from here on: the agent records the failure in the job's AdminComment
            raise

    def _isolate_task(self, task: ProcessInfo, cgroup: SlurmCgroup, request: Mapping[str, str],
                      job_devices: Callable[[str], JobDevices], mounts: tuple[str | None, str | None],
                      scope: str, from_root: bool, mounted_root: str = "/") -> Outcome:
        claimed = request.get("SLURM_JOB_ID")
        if claimed is not None and claimed != cgroup.job_id:
            raise IsolationError(f"the request says job {claimed!r}, but task {task.pid} is in job {cgroup.job_id}'s cgroup")
        devices = job_devices(cgroup.job_id)
        key = (cgroup.job_id, cgroup.step)
        asked = gpus_of_step(devices.job_gpus, devices.mapping, cgroup.step, request.get("SLURM_STEP_GPUS"))
        with self.lock:
            if from_root and request.get("MAPA_STEP_ENV") == "1":
                # The SPANK plugin: the step's environment, before Slurm narrows it per task.
                if len(self.steps) > 100000:
                    self.steps.clear()
                self.steps[key] = asked
                step, task_gpus = asked, None
            elif from_root:  # a plugin of an earlier release sends nothing of the step: the job's
                step, task_gpus = devices.job_gpus, None
            else:  # a TaskProlog: its task's GPUs, under a binding; the step's from the plugin when it asked
                step = self.steps.get(key)
                if step is None and cgroup.version == 1 and mounts[0] is not None and is_numbered_step(cgroup.step):
                    step = self._v1_step_from_kernel(Path(mounts[0]), cgroup, devices)
                if step is None:
                    # No plugin: the step's GPUs are unknown (each task sees its own); the job's
                    # cgroup holds, and a step of no GPUs (the task has none either) none.
                    step = asked if not asked else devices.job_gpus
                elif not set(asked) <= set(step):
                    asked = step  # the task's variables say more than its step has: the step's
                task_gpus = asked if scope == "task" and asked != step else None
            levels = [(None, devices.job_gpus), ("step", step if step != devices.job_gpus else None),
                      ("task", task_gpus)]
            rules = {level: device_rules(devices.vendor, map(devices.minors, gpus)) for level, gpus in levels
                     if gpus is not None}
            openable = task_gpus if task_gpus is not None else step
            gpus = ",".join(map(str, openable)) or "none"
            if len(self.configured) > 100000:  # months of jobs: forget; a cgroup is only written again
                self.configured.clear()
            if cgroup.version == 1:
                if mounts[0] is None:
                    raise IsolationError("Slurm uses cgroup v1 here, but no v1 devices hierarchy is mounted")
                if "task" in rules and cgroup.task is None:
                    raise IsolationError(f"task {task.pid}'s v1 cgroups name no task level: no per-task isolation")
                held = self._v1_narrower_already(Path(mounts[0]), task.pid, cgroup, devices,
                                                 2 if "task" in rules else 1 if "step" in rules else 0, openable, mounted_root)
                if held is not None:
                    where, kept = held
                    kept_text = ",".join(map(str, kept)) or "none"
                    return Outcome("cgroup-v1", cgroup.job_id, cgroup.step,
                                   f"gpus={kept_text} job {cgroup.job_id} step {cgroup.step} task pid {task.pid}: GPUs {kept_text} "
                                   f"in {where} (kept: a task is never moved to a wider cgroup)", tuple(kept))
                if task_gpus is not None and cgroup.task is not None:
                    if len(self.tasks) > 100000:
                        self.tasks.clear()
                    self.tasks[(cgroup.job_id, cgroup.step, cgroup.task)] = task_gpus
                where = apply_v1(Path(mounts[0]), cgroup.job_id, rules[None], cgroup.step, rules.get("step"), task.pid,
                                 configured=self.configured, task=cgroup.task, task_rules=rules.get("task"))
                return Outcome("cgroup-v1", cgroup.job_id, cgroup.step,
                               f"gpus={gpus} job {cgroup.job_id} step {cgroup.step} task pid {task.pid}: GPUs {gpus} in {where}",
                               tuple(openable))
            if mounts[1] is None:
                raise IsolationError("Slurm uses cgroup v2 here, but no cgroup2 file system is mounted")
            done = apply_v2(Path(mounts[1]), cgroup, rules[None], rules.get("step"), self.attach, self.configured,
                            task_rules=rules.get("task"))
            return Outcome("cgroup-v2", cgroup.job_id, cgroup.step, f"gpus={gpus} job {cgroup.job_id} step {cgroup.step}: GPUs {gpus}"
                           + (f" (programs attached to {', '.join(map(str, done))})" if done else ""), tuple(openable))


    def sweep_v1(self, job_devices: Callable[[str], JobDevices], limit: int = 100000) -> dict[str, int]:
        """Isolate, at their job's level, the processes of Slurm tasks on this node that are in no
        MAPA devices cgroup of their job: tasks that started while no mapa-agent answered (it was
        down, restarting, or flooded), which the TaskProlog let run (fail-open). The kernel says
        which they are (/proc/PID/cgroup), not this process's memory. Jobs MAPA does not know here
        (no job file, no mark) and root's processes (Slurm's own daemons) are left alone. Job id ->
        how many processes were moved. cgroup v1 only: on v2 nothing tells whether a job's cgroup
        has the program (a re-attach on every pass would pile programs up)."""
        try:
            all_mounts = read_mounts(self.mountinfo)
        except IsolationError:
            return {}
        devices, _ = mount_points(all_mounts)
        if devices is None:
            return {}
        root = devices_root(all_mounts)
        moved: dict[str, int] = {}
        rules_of: dict[str, object] = {}
        try:
            pids = [int(entry.name) for entry in os.scandir(self.proc) if entry.name.isdigit()][:limit]
        except OSError:
            return {}
        for pid in pids:
            try:
                text = read_proc_cgroup(self.proc, pid)
                cgroup = slurm_cgroup_of(text, all_mounts)
                if cgroup is None or cgroup.version != 1 or mapa_job_cgroup_level(devices_cgroup_path(text), cgroup.job_id,
                                                                                   devices_root=root):
                    continue
                info = read_process(self.proc, pid)
            except (OSError, ValueError, IsolationError):
                continue  # gone meanwhile, or in no cgroup slurmd made: no Slurm task
            if info.uids[0] == 0 or cgroup.uid != info.uids[0]:
                continue
            if cgroup.job_id not in rules_of:
                try:
                    job = job_devices(cgroup.job_id)
                    rules_of[cgroup.job_id] = device_rules(job.vendor, map(job.minors, job.job_gpus))
                except (IsolationError, MapaError):
                    rules_of[cgroup.job_id] = None
            rules = rules_of[cgroup.job_id]
            if rules is None:
                continue
            with self.lock:
                try:
                    apply_v1(Path(devices), cgroup.job_id, rules, None, None, pid, configured=self.configured)  # type: ignore[arg-type]
                except IsolationError:
                    continue  # the process ended, or the cgroup cannot be written: the next pass tries again
            moved[cgroup.job_id] = moved.get(cgroup.job_id, 0) + 1
        return moved

    def _v1_narrower_already(self, devices_root: Path, pid: int, cgroup: SlurmCgroup, devices: JobDevices,
                             target_depth: int, asked: tuple[int, ...], mounted_root: str = "/") -> tuple[Path, tuple[int, ...]] | None:
        """Where task ``pid`` already is, and what it may open there, when that is a MAPA cgroup of
        its own job and step deeper than the request's (0 job, 1 step, 2 task); else None. A task
        is never moved up: a second request from the same task (a user's own --task-prolog after
        the site's TaskProlog, or a request after an agent restart that knows less of the step)
        cannot widen what the first one narrowed. The GPUs come from the kernel's list of that
        cgroup, else from what this agent configured there, else (a default-allow cgroup after a
        restart: the kernel does not list it) the request's own set is named, the task staying put."""
        try:
            level = mapa_job_cgroup_level(devices_cgroup_path(read_proc_cgroup(self.proc, pid)), cgroup.job_id,
                                          devices_root=mounted_root)
        except OSError:
            return None
        if level is None or (level[0] is not None and level[0] != cgroup.step):
            return None
        step, task = level
        depth = 2 if task is not None else 1 if step is not None else 0
        if depth <= target_depth:
            return None
        _, step_dir = v1_directories(devices_root, cgroup.job_id, cgroup.step)
        if step_dir is None:
            return None
        where = step_dir / f"task_{task}" if depth == 2 else step_dir
        kept = self._gpus_allowed_in(where, devices)
        if kept is None:
            kept = self.tasks.get((cgroup.job_id, cgroup.step, task)) if depth == 2 else self.steps.get((cgroup.job_id, cgroup.step))
        return where, kept if kept is not None else asked

    def _v1_step_from_kernel(self, devices_root: Path, cgroup: SlurmCgroup, devices: JobDevices) -> tuple[int, ...] | None:
        """A step's GPUs as its v1 devices cgroup (written for the SPANK plugin's request before
        this agent restarted) allows them: the kernel's state, not this process's memory. None
        where the kernel cannot say (no step cgroup; a default-allow one, whose list the kernel
        does not show): the task then gets its job's cgroup, as without the plugin."""
        _, step_dir = v1_directories(devices_root, cgroup.job_id, cgroup.step)
        return self._gpus_allowed_in(step_dir, devices) if step_dir is not None else None

    @staticmethod
    def _gpus_allowed_in(directory: Path, devices: JobDevices) -> tuple[int, ...] | None:
        """The job's GPUs that the v1 devices cgroup ``directory`` lets open, as the kernel lists
        them; None where its list cannot say."""
        (rule,) = device_rules(devices.vendor, [])
        minors = v1_minors_allowed_in(directory, rule)
        return None if minors is None else tuple(gpu for gpu in devices.job_gpus if devices.minors(gpu) in minors)


def effective_mode(config, node: str) -> tuple[str, str]:
    """mapa.toml's ``isolation`` on ``node``, and why. "auto" (the default) is "fail-open" where the
    node's topology file names each GPU's device minor (``minor_numbers``, which discovery from
    NVML or AMD SMI writes), and "off" elsewhere: a preset or saved `nvidia-smi topo -m` text does
    not say which /dev/nvidiaN is which GPU, and a wrong guess would deny jobs their own GPUs."""
    from ...hardware.load import load_topology_file

    if config.isolation != "auto":
        return config.isolation, f'isolation = "{config.isolation}" in mapa.toml'
    spec = config.topology_for(node)
    if spec is None:
        return "off", f"auto: no [nodes] entry of mapa.toml matches node {node}"
    try:
        topology = load_topology_file(spec)
    except (OSError, MapaError) as error:
        return "off", f"auto: cannot read node {node}'s topology {spec}: {error}"
    if topology.minor_numbers is None:
        return "off", (f"auto: node {node}'s topology {spec} names no device minor numbers "
                       "(a file from `mapa topo discover` with NVML or AMD SMI does)")
    return "fail-open", f"auto: node {node}'s topology {spec} names each GPU's device file"


def job_devices_for(config, node: str, dev: Path = Path("/dev")) -> Callable[[str], JobDevices]:
    """For a job id: the GPUs the job uses on this node (its job file, else Slurm's GPUs from the
    Prolog's mark, none for a job without GPUs) and their device numbers (the node's topology
    file's ``minor_numbers``, else the index; AMD render nodes 128 + the index)."""
    from ...hardware.load import load_topology_file
    from ..node_state import NodeState

    state = NodeState.of(config)

    def lookup(job_id: str) -> JobDevices:
        gpus: tuple[int, ...] | None = None
        mapping = None
        try:
            mapping = state.job_mapping(job_id)
            gpus = mapping.gpus
        except (OSError, ValueError):
            try:
                gpus = state.read_mark(job_id).slurm_gpus
            except (OSError, ValueError):
                error = IsolationError(f"job {job_id} has no job file and no Prolog mark in {config.jobs_dir}: "
                                       "its Prolog did not run on this node")
                error.unknown_job = True
                raise error from None
        spec = config.topology_for(node)
        if spec is None:
            vendor = "amd" if (dev / "kfd").exists() else "nvidia"
            base = RENDER_MINORS[0] if vendor == "amd" else 0
            return JobDevices(vendor, gpus, lambda gpu: base + gpu, mapping)
        try:
            topology = load_topology_file(spec)
        except (OSError, MapaError) as error:
            raise IsolationError(f"cannot read node {node}'s topology {spec}: {error}") from None
        if any(gpu >= topology.graph.size for gpu in gpus):
            raise IsolationError(f"job {job_id}'s GPUs {list(gpus)} are not all among the {topology.graph.size} of {spec}")
        return JobDevices(topology.gpu_vendor, gpus, topology.minor, mapping)

    return lookup
