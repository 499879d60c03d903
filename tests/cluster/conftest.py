"""Fixtures for tests that run against the dockerized mini Slurm cluster (docs/cluster.md).

The session fixture ``cluster`` builds the image and starts the cluster with ``scripts/cluster up``
the first time a test asks for it, and always tears it down at the end of the session
(``MAPA_KEEP_CLUSTER=1`` leaves it running for debugging). It is parametrized by Slurm release
(``MAPA_SLURM_RELEASES``, default ``26.05,24.11``): every cluster test runs once on each, and
each release's cluster has its own containers and subnet, so the two can run at the same time
(``scripts/test`` runs them in two pytest-xdist workers). Tests that need it carry
``@pytest.mark.cluster``. Without a Docker engine they are skipped, unless
``MAPA_REQUIRE_CLUSTER=1`` is set: then a missing engine, like a cluster that fails to start, is a
test failure. When a cluster test fails, the tail of every container's log is attached to its
report and the full logs are written under ``build/cluster-logs/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = ROOT / "scripts" / "cluster"
LOG_DIR = Path(os.environ.get("MAPA_CLUSTER_LOG_DIR", ROOT / "build" / "cluster-logs"))

#: Mock GPU servers: node name -> (preset, GPU count).
NODES: dict[str, tuple[str, int]] = {
    "dgx1": ("dgx1-v100", 8),
    "torus1": ("torus2d-16", 16),
    "summit1": ("summit", 6),
    "mi250x1": ("mi250x", 8),
    "dgx2": ("dgx1-v100", 8),
}
SERVICES = ("mariadb", "slurmdbd", "slurmctld", *NODES)
CONTROLLER = "slurmctld"
JOB_DIR = "/shared/jobs"
DEFAULT_USER = "alice"
#: Job states after which a job never changes again (apart from a requeue).
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
#: Slurm release -> (compose project / container prefix, subnet prefix). 26.05's cluster has the
#: names scripts/cluster gives by default (mapa-dgx1, ...).
RELEASE_CLUSTERS: dict[str, tuple[str, str]] = {
    "26.05": ("mapa", "10.213.77"),
    "24.11": ("mapa-24-11", "10.213.78"),
}
RELEASES = tuple(r.strip() for r in os.environ.get("MAPA_SLURM_RELEASES", "26.05,24.11").split(",") if r.strip())
UP_TIMEOUT = float(os.environ.get("MAPA_CLUSTER_UP_TIMEOUT", "2400"))
_SACCT_DELIMITER = "\x1f"


def _require_cluster() -> bool:
    return os.environ.get("MAPA_REQUIRE_CLUSTER") == "1"


@functools.cache
def engine_problem() -> str | None:
    """Why no cluster can be started here, or None when a Docker engine is usable."""
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        proc = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker info failed: {exc}"
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return "no Docker engine reachable: " + (lines[-1] if lines else f"docker info exited {proc.returncode}")
    return None


def _skip_or_fail(reason: str) -> None:
    if _require_cluster():
        pytest.fail(f"MAPA_REQUIRE_CLUSTER=1 but {reason}", pytrace=False)
    pytest.skip(f"cluster tests need a Docker engine: {reason}")


class ClusterError(AssertionError):
    """A cluster command failed or a wait ran out; the message says what was seen."""


class Cluster:
    """Handle on the running cluster; every Slurm command runs inside the containers."""

    nodes = NODES
    job_dir = JOB_DIR
    Error = ClusterError

    def __init__(self, release: str = "26.05") -> None:
        if release not in RELEASE_CLUSTERS:
            raise ValueError(f"MAPA_SLURM_RELEASES names {release!r}; the cluster is built for {', '.join(RELEASE_CLUSTERS)}")
        self.release = release
        self.name, subnet = RELEASE_CLUSTERS[release]
        #: The environment scripts/cluster runs with for this release's cluster.
        self.script_env = {**os.environ, "MAPA_SLURM": release, "MAPA_CLUSTER": self.name, "MAPA_SUBNET_PREFIX": subnet}
        self.script_env.pop("MAPA_IMAGE", None)
        self.submitted: list[int] = []
        self.startup_seconds: float | None = None

    # -- running commands ----------------------------------------------------------------------

    def container(self, service: str) -> str:
        return f"{self.name}-{service}"

    def script(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """scripts/cluster for this release's cluster."""
        return subprocess.run([str(CLUSTER_SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=self.script_env)

    def exec(
        self,
        node: str,
        argv: Iterable[str],
        *,
        user: str | None = None,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv in the container of ``node`` (a node or service name), as root or ``user``."""
        argv = list(argv)
        if user is not None:
            argv = ["runuser", "-u", user, "--", *argv]
        cmd = ["docker", "exec", *(["-i"] if input is not None else []), self.container(node), *argv]
        # Slurm prints what users gave it byte for byte (a Latin-1 job name, a batch script): keep
        # bytes that are not UTF-8 as surrogates instead of failing to decode them.
        proc = subprocess.run(cmd, input=input, capture_output=True, encoding="utf-8", errors="surrogateescape", timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(
                f"{' '.join(argv)} on {node} exited {proc.returncode}\n"
                f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}"
            )
        return proc

    def run(self, *argv: str, user: str | None = None, **kwargs) -> str:
        """Run a command on the controller and return its stdout."""
        return self.exec(CONTROLLER, argv, user=user, **kwargs).stdout

    def scontrol_json(self, *args: str) -> dict:
        """``scontrol --json <args>`` on the controller, parsed (data_parser v0.0.42 field names)."""
        return json.loads(self.run("scontrol", "--json", *args))

    # -- jobs ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def hook_config(self, nodes: Iterable[str], extra: str, edit: Callable[[str], str] = lambda text: text):
        """mapa.toml on ``nodes``: the file in force, after ``edit``, with ``extra`` appended, while
        the block runs (every hook reads it afresh); the file as it was afterwards. Built on the file
        in force, not the shipped one, so that blocks nest (a module's settings stay under a test's)."""
        nodes = tuple(nodes)
        before = {node: self.exec(node, ["cat", "/etc/slurm/mapa.toml"]).stdout for node in nodes}
        try:
            for node in nodes:
                self._write_hook_config(node, edit(before[node]) + extra)
            yield
        finally:
            for node in nodes:
                self._write_hook_config(node, before[node], check=False)

    def _write_hook_config(self, node: str, text: str, check: bool = True) -> None:
        self.exec(node, ["sh", "-c", "umask 022 && cat > /etc/slurm/mapa.toml.new && mv /etc/slurm/mapa.toml.new /etc/slurm/mapa.toml"],
                  input=text, check=check)

    def ledger_jobs(self, node: str) -> dict:
        """The jobs of MAPA's ledger on ``node`` (job id -> its entry: gpus, policy, since, note);
        {} while the node has no ledger yet."""
        out = self.exec(node, ["cat", "/var/lib/slurm-mapa/ledger.json"], check=False).stdout
        return json.loads(out)["jobs"] if out.strip() else {}

    def sbatch(self, script_text: str, *args: str, user: str = DEFAULT_USER) -> int:
        """Submit a batch script as ``user`` and return its job id.

        The job runs in the shared job directory and writes ``<jobid>.out`` there (read it with
        :meth:`output`); extra sbatch options go in ``args`` and may override these.
        """
        out = self.run(
            "sbatch",
            "--parsable",
            f"--chdir={JOB_DIR}",
            f"--output={JOB_DIR}/%j.out",
            *args,
            user=user,
            input=script_text,
        )
        jobid = int(out.strip().split(";")[0])
        self.submitted.append(jobid)
        return jobid

    def job(self, jobid: int) -> dict | None:
        """The controller's record of a job (``scontrol --json show job``), None once purged."""
        proc = self.exec(CONTROLLER, ["scontrol", "--json", "show", "job", str(jobid)], check=False)
        if proc.returncode != 0:
            if "Invalid job id" in proc.stdout + proc.stderr:
                return None
            raise ClusterError(f"scontrol show job {jobid} failed: {proc.stderr.strip()}")
        jobs = json.loads(proc.stdout).get("jobs", [])
        return jobs[0] if jobs else None

    def state(self, jobid: int) -> str:
        """Current state of a job: the controller's, or sacct's once the controller forgot it."""
        job = self.job(jobid)
        if job is not None:
            return job["job_state"][0]
        return self.sacct(jobid, ("State",))["State"].split()[0]

    def wait_state(
        self,
        jobid: int,
        states: str | Iterable[str],
        timeout: float = 60,
        poll: float = 0.5,
    ) -> dict:
        """Poll until the job is in one of ``states``; return its ``scontrol --json`` record.

        Fails at once when the job reaches a different final state, and after ``timeout`` seconds
        with the job's last state and reason.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        last: dict | None = None
        while True:
            last = self.job(jobid)
            if last is None:
                current = {self.state(jobid)}
            else:
                current = set(last["job_state"])
            if current & wanted:
                return last if last is not None else {"job_id": jobid, "job_state": sorted(current)}
            if current & TERMINAL_STATES:
                raise ClusterError(f"job {jobid} ended {sorted(current)}, not {sorted(wanted)}: {_job_summary(last)}")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"job {jobid} not {sorted(wanted)} after {timeout}s; now {sorted(current)}: {_job_summary(last)}"
                )
            time.sleep(poll)

    def why_not_started(self, jobid: int, lines: int = 15) -> str:
        """For a job whose script printed nothing: its record, and the MAPA log lines that name it
        on its nodes (a CI failure shows only the containers' last lines)."""
        job = self.job(jobid)
        text = _job_summary(job)
        for node in sorted(set(filter(None, re.split(r"[,\s]+", str((job or {}).get("nodes", "")))))):  # the cluster has no node ranges
            proc = self.exec(node, ["grep", "-aw", f"job {jobid}", "/var/log/slurm-mapa.log"], check=False)
            text += f"\n--- {node}: MAPA log lines of job {jobid} ---\n" + "\n".join(proc.stdout.splitlines()[-lines:])
        return text

    def wait_job(
        self,
        jobid: int,
        predicate: Callable[[dict], bool],
        timeout: float = 60,
        poll: float = 0.5,
        what: str = "",
    ) -> dict:
        """Poll the job's ``scontrol --json`` record until ``predicate(record)`` holds."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(jobid)
            if job is not None and predicate(job):
                return job
            if time.monotonic() > deadline:
                raise ClusterError(f"job {jobid} not {what or 'as expected'} after {timeout}s: {_job_summary(job)}")
            time.sleep(poll)

    def output(self, jobid: int) -> str:
        """The job's stdout file (the default ``--output`` set by :meth:`sbatch`)."""
        return self.run("cat", f"{JOB_DIR}/{jobid}.out")

    def cancel(self, *jobids: int) -> None:
        if jobids:
            self.run("scancel", *map(str, jobids), check=False)

    def sacct(self, jobid: int, fields: Iterable[str] = ("JobID", "State", "AllocTRES", "Comment")) -> dict[str, str]:
        """The job's allocation line in ``sacct`` (``-X``) as {field: value}; {} when not recorded yet."""
        fields = list(fields)
        out = self.run(
            "sacct",
            "-a",
            "-X",
            "-n",
            "-P",
            f"--delimiter={_SACCT_DELIMITER}",
            "-j",
            str(jobid),
            "-o",
            ",".join(fields),
        )
        for line in out.splitlines():
            values = line.split(_SACCT_DELIMITER)
            if len(values) == len(fields):
                return dict(zip(fields, values))
        return {}

    def wait_sacct(
        self,
        jobid: int,
        fields: Iterable[str] = ("JobID", "State", "AllocTRES", "Comment"),
        timeout: float = 30,
        poll: float = 0.5,
        **expected: str | Callable[[str], bool],
    ) -> dict[str, str]:
        """Poll sacct until the job's record has the ``expected`` field values (or predicates).

        Accounting reaches slurmdbd asynchronously, so a job that just ended may lag in sacct.
        """
        fields = list(dict.fromkeys([*fields, *expected]))
        deadline = time.monotonic() + timeout
        while True:
            rec = self.sacct(jobid, fields)
            if rec and all(_matches(rec[k], v) for k, v in expected.items()):
                return rec
            if time.monotonic() > deadline:
                raise ClusterError(f"sacct for job {jobid} not {expected} after {timeout}s; last record {rec}")
            time.sleep(poll)

    # -- nodes ---------------------------------------------------------------------------------

    def node(self, name: str) -> dict:
        """The controller's record of a node (``scontrol --json show node``)."""
        return self.scontrol_json("show", "node", name)["nodes"][0]

    def wait_node(
        self,
        name: str,
        predicate: Callable[[set[str]], bool],
        timeout: float = 60,
        poll: float = 0.5,
        what: str = "",
    ) -> dict:
        """Poll until ``predicate(node state flags)`` holds, e.g. ``lambda s: s == {"IDLE"}``."""
        deadline = time.monotonic() + timeout
        while True:
            node = self.node(name)
            if predicate(set(node["state"])):
                return node
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"node {name} not {what or 'as expected'} after {timeout}s; "
                    f"state {node['state']} reason {node.get('reason')!r}"
                )
            time.sleep(poll)

    def restart_controller(self, timeout: float = 120) -> None:
        """Restart the slurmctld container (its state is saved in the container) and wait until it answers."""
        subprocess.run(["docker", "restart", self.container(CONTROLLER)], check=True, capture_output=True, timeout=120)
        deadline = time.monotonic() + timeout
        while "UP" not in self.exec(CONTROLLER, ["scontrol", "ping"], check=False).stdout:
            if time.monotonic() > deadline:
                raise ClusterError(f"slurmctld did not answer within {timeout}s of its restart")
            time.sleep(1)

    def kill_node(self, name: str) -> None:
        subprocess.run(["docker", "kill", self.container(name)], check=True, capture_output=True, timeout=60)

    def start_node(self, name: str) -> None:
        subprocess.run(["docker", "start", self.container(name)], check=True, capture_output=True, timeout=60)

    # -- diagnostics ---------------------------------------------------------------------------

    def logs(self, tail: int | None = None) -> str:
        """Every container's log, one section per service."""
        parts = []
        for service in SERVICES:
            cmd = ["docker", "logs", "--timestamps"]
            if tail is not None:
                cmd += ["--tail", str(tail)]
            try:
                proc = subprocess.run(
                    [*cmd, self.container(service)], capture_output=True, encoding="utf-8", errors="replace", timeout=60
                )
                text = proc.stdout + proc.stderr
            except (OSError, subprocess.TimeoutExpired) as exc:
                text = f"(no log: {exc})"
            parts.append(f"===== {service} =====\n{text.rstrip()}\n")
        return "\n".join(parts)

    def dump_logs(self, label: str) -> Path:
        """Write every container's full log under build/cluster-logs/ and return the directory."""
        target = LOG_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-slurm-{self.release}-{label}"
        target.mkdir(parents=True, exist_ok=True)
        (target / "containers.log").write_text(self.logs())
        try:
            status = self.script("status", timeout=120)
            (target / "status.txt").write_text(status.stdout + status.stderr)
        except (OSError, subprocess.TimeoutExpired):
            pass
        return target


def _matches(value: str, expected: str | Callable[[str], bool]) -> bool:
    return expected(value) if callable(expected) else value == expected


def _job_summary(job: Mapping | None) -> str:
    if job is None:
        return "(no longer known to slurmctld)"
    keys = ("job_state", "state_reason", "nodes", "gres_detail", "exit_code", "comment")
    return ", ".join(f"{k}={job.get(k)!r}" for k in keys if k in job)


# -- fixtures and hooks -----------------------------------------------------------------------

_failed_cluster_tests: dict[str, list[str]] = {}


@pytest.fixture(scope="session", params=RELEASES)
def cluster(request: pytest.FixtureRequest) -> Cluster:
    """The running mini cluster of one Slurm release, started once per session and torn down at its end."""
    problem = engine_problem()
    if problem:
        _skip_or_fail(problem)
    handle = Cluster(request.param)
    lock = _exclusive_cluster_lock(handle.name)

    def teardown() -> None:
        try:
            _teardown()
        finally:
            lock.close()

    def say(text: str) -> None:
        reporter = request.config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(text)

    def _teardown() -> None:
        if _failed_cluster_tests.get(handle.release):
            where = handle.dump_logs("failure")
            say(f"cluster logs of the failed session written to {where}")
        if os.environ.get("MAPA_KEEP_CLUSTER") == "1":
            say("MAPA_KEEP_CLUSTER=1: the cluster keeps running (scripts/cluster down stops it)")
            return
        handle.script("down", timeout=300)

    request.addfinalizer(teardown)
    start = time.monotonic()
    try:
        proc = handle.script("up", timeout=UP_TIMEOUT)
    except subprocess.TimeoutExpired:
        where = handle.dump_logs("up-timeout")
        pytest.fail(
            f"scripts/cluster up (Slurm {handle.release}) did not finish within {UP_TIMEOUT:.0f}s; container logs in {where}", pytrace=False
        )
    if proc.returncode != 0:
        # This failure is reported again for every test that wanted the cluster: keep it short
        # and put the container logs in a file.
        where = handle.dump_logs("up-failed")
        pytest.fail(
            f"scripts/cluster up (Slurm {handle.release}) exited {proc.returncode}; container logs in {where}\n"
            + "\n".join(proc.stderr.strip().splitlines()[-25:]),
            pytrace=False,
        )
    handle.startup_seconds = time.monotonic() - start
    return handle


def _exclusive_cluster_lock(name: str):
    """Hold a host-wide lock on one cluster for the session: two test sessions on one Docker
    engine would otherwise start and tear down the same containers under each other."""
    path = Path(os.environ.get("MAPA_CLUSTER_LOCK_DIR", "/tmp")) / f"slurm-mapa-cluster-{name}.lock"
    handle = path.open("a")
    deadline = time.monotonic() + UP_TIMEOUT
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.close()
                pytest.fail(f"another test session held {path} for {UP_TIMEOUT:.0f}s", pytrace=False)
            time.sleep(1)


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs(request: pytest.FixtureRequest):
    """Cancel the jobs a cluster test submitted and did not see finish, so tests stay independent."""
    if "cluster" not in request.fixturenames:
        yield
        return
    handle: Cluster = request.getfixturevalue("cluster")
    before = len(handle.submitted)
    yield
    handle.cancel(*handle.submitted[before:])


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cluster") is not None:
        problem = engine_problem()
        if problem:
            _skip_or_fail(problem)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    # Only failures of the tests themselves: a failed bring-up already wrote the logs to a file.
    if report.failed and call.when != "setup" and "cluster" in getattr(item, "fixturenames", ()):
        release = item.callspec.params.get("cluster", RELEASES[0]) if hasattr(item, "callspec") else RELEASES[0]
        _failed_cluster_tests.setdefault(release, []).append(item.nodeid)
        try:
            tail = Cluster(release).logs(tail=60)
        except Exception as exc:  # diagnostics must never mask the real failure
            tail = f"(could not read container logs: {exc})"
        report.sections.append(("cluster logs (last 60 lines per container)", tail))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist's ``--dist loadgroup``, all tests of one release's cluster run in one
    worker (the cluster is a session fixture of that worker), and the releases' in parallel."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "cluster" in callspec.params:
            item.add_marker(pytest.mark.xdist_group(f"slurm-{callspec.params['cluster']}"))
