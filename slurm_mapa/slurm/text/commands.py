"""Thin adapters over scontrol and squeue: pure parsers of their output, one runner with a timeout.

The hooks have no PATH (Slurm runs them with an empty environment), so the binaries are named by
absolute path from the config. No shell is ever involved.

Everything Slurm prints may hold any bytes (a job name, a batch script saved as Latin-1), so the
runner never decodes strictly: it reads bytes, bounds them, and decodes with ``errors="replace"``
(a bad byte becomes U+FFFD, which the directive grammar then refuses as non-ASCII). The parsers
bound their input before any per-item work, so no output, however hostile, costs more than
linear time and a few MiB; each raises only what its docstring says.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

RunCommand = Callable[[Sequence[str]], str]  # argv -> stdout; CommandFailed otherwise
Log = Callable[[str], None]  # one line to the hooks' log

MAX_OUTPUT_BYTES = 4 << 20  # stdout of one command; more is an error, and the command is killed
MAX_STDERR_BYTES = 64 << 10  # stderr kept for the error message (the rest is read and dropped)
MAX_GPU_INDEX = 1023  # the highest GPU index any list may name (Slurm's nodes have far fewer)
MAX_GPU_LIST_CHARS = 16 << 10  # one GPU index list as text: 1024 indices written out take ~4 KiB
MAX_INDEX_DIGITS = 6  # digits of one index (leading zeros allowed, within reason)
_JOB_ID = re.compile(r"[0-9]{1,12}")
_GPU_PART = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_ACCEPTED_GPUS = f"accepted: indices 0 to {MAX_GPU_INDEX} and ranges like 0,2-3, each index once"


class CommandFailed(RuntimeError):
    """A Slurm command failed, timed out or printed something unreadable."""


TIMED_OUT = "timed out after"  # in a CommandFailed's message when the command did not answer in time


def timed_out(message: str) -> bool:
    """Whether a CommandFailed's message says the command did not answer in time (not that it failed)."""
    return f" {TIMED_OUT} " in message


@dataclass(frozen=True)
class Runner:
    """Runs a command without a shell, bounded in time and output.

    The command runs in its own session, so a timeout kills it and everything it started (a
    wrapper script's ``sleep`` would otherwise hold the pipes open past the timeout).
    """

    timeout: float = 5.0
    env: Mapping[str, str] | None = None  # the command's environment; None: only LC_ALL=C (all Slurm's need)

    def __call__(self, argv: Sequence[str], stdin: str | None = None, timeout: float | None = None) -> str:
        """The command's stdout, decoded with replacement. ``timeout`` lowers the runner's own
        timeout for this call (a caller with a time budget); it never raises it."""
        limit = self.timeout if timeout is None else min(self.timeout, timeout)
        if not argv:
            raise CommandFailed("no command given")
        name = argv[0]
        if not limit > 0:
            raise CommandFailed(f"{name} not run: no time left (timeout {limit:g} s)")
        data = None if stdin is None else stdin.encode("utf-8", "replace")
        try:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"LC_ALL": "C"} if self.env is None else dict(self.env),
                start_new_session=True,
                close_fds=True,
            )
        except (OSError, ValueError) as error:  # ValueError: a NUL byte in an argument
            raise CommandFailed(f"cannot run {name}: {getattr(error, 'strerror', None) or error}") from None
        with process:
            try:
                out, err, problem = _collect(process, data, time.monotonic() + limit)
            except BaseException:  # a signal's exception, a read error: leave nothing running behind
                _kill_group(process)
                raise
            if problem:
                _kill_group(process)
                process.wait()
                what = f"{TIMED_OUT} {limit:g} s" if problem == "timeout" else f"printed more than {MAX_OUTPUT_BYTES} bytes"
                raise CommandFailed(f"{name} {what}")
        stderr = err.decode("utf-8", "replace").strip()
        if process.returncode != 0:
            raise CommandFailed(f"{' '.join(argv[:3])} exited {process.returncode}: {stderr[:300]}")
        return out.decode("utf-8", "replace")


def _collect(process: subprocess.Popen, data: bytes | None, deadline: float) -> tuple[bytes, bytes, str]:
    """Feed stdin, read stdout and stderr until both close and the process exits.

    Returns (stdout, stderr, problem) where problem is "", "timeout" or "too much"; on a problem
    the process is still running (or a zombie not yet reaped), so its group may be killed.
    """
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        assert process.stdout is not None and process.stderr is not None
        selector.register(process.stdout, selectors.EVENT_READ, out)
        selector.register(process.stderr, selectors.EVENT_READ, err)
        pending = memoryview(data or b"")
        if process.stdin is not None:
            if pending:
                os.set_blocking(process.stdin.fileno(), False)
                selector.register(process.stdin, selectors.EVENT_WRITE, None)
            else:
                process.stdin.close()
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), bytes(err), "timeout"
            for key, _ in selector.select(left):
                if key.data is None:  # stdin
                    try:
                        pending = pending[os.write(key.fd, pending[:65536]) :]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer: bytearray = key.data
                if buffer is out:
                    out += chunk
                    if len(out) > MAX_OUTPUT_BYTES:
                        return bytes(out), bytes(err), "too much"
                elif len(err) < MAX_STDERR_BYTES:
                    err += chunk[: MAX_STDERR_BYTES - len(err)]
    try:
        process.wait(max(deadline - time.monotonic(), 0.001))
    except subprocess.TimeoutExpired:
        return bytes(out), bytes(err), "timeout"
    return bytes(out), bytes(err), ""


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the command's session (its pid is its group id and is not reaped yet, so not reused)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()


def is_job_id(text: object) -> bool:
    """A plain Slurm job id: 1 to 12 ASCII digits and nothing else (no newline, no sign)."""
    return isinstance(text, str) and _JOB_ID.fullmatch(text) is not None


def parse_job_json(text: str, job_id: str | None = None) -> dict:
    """Job ``job_id``'s record in `scontrol --json show job ID` (without ``job_id``: the first).

    `scontrol show job N` lists every task of an array whose array job id is N (the last task to
    start has N for its own id) and every component of a het job led by N, so the record is
    picked by its own ``job_id``. Raises CommandFailed, and only that, for anything else: too
    long, not JSON, nested too deeply for the parser (RecursionError), or no such job record.
    """
    if len(text) > MAX_OUTPUT_BYTES:
        raise CommandFailed(f"scontrol --json show job printed {len(text)} characters (accepted: at most {MAX_OUTPUT_BYTES})")
    try:
        data = json.loads(text)
        jobs = data["jobs"]
        if not isinstance(jobs, list) or not jobs or not all(isinstance(job, dict) for job in jobs[:MAX_RECORDS_SHOWN]):
            raise KeyError("jobs")
    except RecursionError:
        raise CommandFailed("scontrol --json show job printed JSON nested too deeply to read (accepted: a job record)") from None
    except (ValueError, KeyError, TypeError, IndexError):  # ValueError covers JSONDecodeError
        raise CommandFailed(f"scontrol --json show job printed no job (got {text[:60]!r})") from None
    if job_id is None:
        return jobs[0]
    for job in jobs[:MAX_RECORDS_SHOWN]:
        if str(job.get("job_id")) == job_id:
            return job
    raise CommandFailed(f"scontrol --json show job {job_id} printed no record of job {job_id}")


MAX_RECORDS_SHOWN = 100_000  # an array's tasks (MaxArraySize is at most 4,000,001; read this many)

# A job's base states in which slurmctld still takes updates: any other base state is finished
# (IS_JOB_FINISHED in Slurm's slurmctld.h: a base state past JOB_SUSPENDED), and slurmctld refuses
# an update then ("Job has already finished"); COMPLETING and the like are flags beside a base state.
_UNFINISHED_STATES = {"PENDING", "RUNNING", "SUSPENDED"}


def job_states(job: dict) -> set[str]:
    """The state names of a Slurm JSON job record (`scontrol --json show job`, `squeue --json`):
    job_state is a list of names from data_parser v0.0.40 on, a string before; anything else: none."""
    state = job.get("job_state")
    if isinstance(state, str):
        return {state}
    return {name for name in state if isinstance(name, str)} if isinstance(state, list) else set()


def job_finished(job: dict) -> bool:
    """Whether a `scontrol --json show job` record is of a finished job (whose AdminComment
    slurmctld no longer updates); no state, or one not read: not finished (the update will say)."""
    states = job_states(job)
    return bool(states) and not states & _UNFINISHED_STATES


def _number(value: object) -> int | None:
    """A Slurm JSON number: a plain int, or (data_parser v0.0.40+) {"set": true, "number": N}."""
    if isinstance(value, dict):
        value = value.get("number") if value.get("set") is True and not value.get("infinite") else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def job_node_count(job: dict) -> int | None:
    """How many nodes a Slurm JSON job record says the job has (``node_count``); None when it says nothing usable."""
    count = _number(job.get("node_count"))
    return count if count is not None and count > 0 else None


def job_end_time(job: dict) -> float | None:
    """When a Slurm JSON job record says the job ends (``end_time``: Unix seconds; for a running job
    its start plus its time limit); None when unset, infinite or not a positive number."""
    end = _number(job.get("end_time"))
    return float(end) if end is not None and end > 0 else None


def job_time_limit_s(job: dict) -> float | None:
    """A Slurm JSON job record's time limit in seconds (``time_limit`` is in minutes); None when
    unset or infinite."""
    minutes = _number(job.get("time_limit"))
    return minutes * 60.0 if minutes is not None and minutes > 0 else None


def job_records(text: str, what: str) -> list:
    """The ``jobs`` list of a Slurm JSON answer (`squeue --json`, `scontrol --json show job`)."""
    return json_list(text, what, "jobs")


def json_list(text: str, what: str, key: str) -> list:
    """The ``key`` list of a Slurm JSON answer (``jobs``, ``reservations``, ``nodes``).
    CommandFailed, naming ``what`` printed it, for output that is too long, not JSON, not an object
    with a ``key`` list, or that reports errors."""
    if len(text) > MAX_OUTPUT_BYTES:
        raise CommandFailed(f"{what} printed {len(text)} characters (accepted: at most {MAX_OUTPUT_BYTES})")
    try:
        data = json.loads(text)
    except RecursionError:
        raise CommandFailed(f"{what} printed JSON nested too deeply to read (accepted: Slurm's {key} list)") from None
    except ValueError:  # JSONDecodeError, and invalid UTF-8 surrogates
        raise CommandFailed(f"{what} printed something that is not JSON: {text[:120]!r}") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise CommandFailed(f"{what} printed no {key} list (expected an object with \"{key}\": [...]): {text[:120]!r}")
    if data.get("errors"):  # Slurm says the answer is incomplete or wrong
        raise CommandFailed(f"{what} reported errors: {json.dumps(data['errors'])[:200]}")
    return data[key]


def update_target(job: dict, job_id: str) -> str:
    """How `scontrol update` must name job ``job_id`` (its record ``job``) to change it alone: an
    array task as ARRAY_TASK (its own id may be the array's, which names every task), a het
    component as HETJOB+OFFSET (the leader's id names every component); else its id."""
    array, task = _number(job.get("array_job_id")), _number(job.get("array_task_id"))
    het, offset = _number(job.get("het_job_id")), _number(job.get("het_job_offset"))
    if array and task is not None and task >= 0:
        return f"{array}_{task}"
    if het and offset is not None and offset >= 0:
        return f"{het}+{offset}"
    return job_id


def parse_job_ids(text: str) -> set[str]:
    """`squeue -h -o %A` output: one job id per line. CommandFailed for anything else."""
    if len(text) > MAX_OUTPUT_BYTES:
        raise CommandFailed(f"squeue printed {len(text)} characters (accepted: at most {MAX_OUTPUT_BYTES})")
    ids = set()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not is_job_id(line):
            raise CommandFailed(f"squeue printed {line[:40]!r} where a job id was expected")
        ids.add(line)
    return ids


def parse_gpu_indices(text: str) -> tuple[int, ...]:
    """Slurm's GPU index lists as the hooks see them: `0,1,4`, also ranges `0-3`, in the order given.

    ValueError (naming the bad part and what is accepted) for anything else, checked before any
    range is built: non-ASCII digits, an index above MAX_GPU_INDEX, a reversed range, an index
    given twice, more than MAX_GPU_LIST_CHARS characters. Empty parts (`0,,1`, ``""``) are skipped.
    """
    if len(text) > MAX_GPU_LIST_CHARS:
        raise ValueError(f"GPU list of {len(text)} characters ({_ACCEPTED_GPUS}, in at most {MAX_GPU_LIST_CHARS} characters)")
    spans: list[tuple[int, int]] = []
    count = 0
    for part in text.split(","):
        part = part.strip(" \t\r\n")
        if not part:
            continue
        match = _GPU_PART.fullmatch(part)
        if match is None:
            raise ValueError(f"not a GPU index list: {text[:60]!r}, bad part {part[:20]!r} ({_ACCEPTED_GPUS})")
        if any(len(g) > MAX_INDEX_DIGITS for g in match.groups() if g):  # before int(): no huge numbers built
            raise ValueError(f"GPU list {text[:60]!r}: {part[:20]!r} names an index above {MAX_GPU_INDEX} ({_ACCEPTED_GPUS})")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise ValueError(f"GPU list {text[:60]!r}: range {part!r} runs backwards ({_ACCEPTED_GPUS})")
        if high > MAX_GPU_INDEX:
            raise ValueError(f"GPU list {text[:60]!r}: index {high} is above {MAX_GPU_INDEX} ({_ACCEPTED_GPUS})")
        count += high - low + 1
        if count > MAX_GPU_INDEX + 1:
            raise ValueError(f"GPU list {text[:60]!r} names more than {MAX_GPU_INDEX + 1} GPUs ({_ACCEPTED_GPUS})")
        spans.append((low, high))
    gpus = tuple(g for low, high in spans for g in range(low, high + 1))
    if len(set(gpus)) != len(gpus):
        twice = next(g for i, g in enumerate(gpus) if g in gpus[:i])
        raise ValueError(f"GPU list {text[:60]!r} names GPU {twice} twice ({_ACCEPTED_GPUS})")
    return gpus


def show_job_argv(scontrol: str, job_id: str) -> list[str]:
    return [scontrol, "--json", "show", "job", job_id]


def show_jobs_argv(squeue: str, job_ids: Sequence[str]) -> list[str]:
    """Several jobs in one call. Not `scontrol show job J1,J2`: scontrol takes one job id and
    answers a list with "Invalid job id specified" (seen on Slurm 26.05.5). squeue takes a list;
    ``--states=all`` keeps the jobs that have ended; it leaves out the jobs slurmctld no longer
    knows and fails ("Invalid job id specified") only when it knows none of them. Its JSON job
    records are those of `scontrol --json show job` (Slurm's data_parser)."""
    return [squeue, "--json", "--states=all", "--jobs=" + ",".join(job_ids)]


def batch_script_argv(scontrol: str, job_id: str) -> list[str]:
    return [scontrol, "write", "batch_script", job_id, "-"]


MAX_JOBS_PER_READ = 32


def reading_jobs_at_once(run: RunCommand, squeue: str, scontrol: str, job_ids: Sequence[str]) -> RunCommand:
    """``run``, with the first `scontrol --json show job ID` of each of ``job_ids`` answered from
    one `squeue --json` call that lists them all (:func:`show_jobs_argv`): a burst's AdminComment
    records, or the jobs a reconcile pass finds without a mark, cost one read, not one per job
    (each read is an RPC to slurmctld and a process on the node). A job the answer leaves out (gone)
    and every job of an answer that cannot be read are read alone, as before; when slurmctld does
    not answer, each read fails as that call did, without asking again. Writes stay one per job:
    `scontrol update` sets one text for every job it names."""
    ids = list(dict.fromkeys(job_ids))[:MAX_JOBS_PER_READ]
    if len(ids) < 2:
        return run
    answers: dict = {}
    try:
        text = run(show_jobs_argv(squeue, ids))
    except CommandFailed as error:
        if "Invalid job id" in str(error):
            return run  # slurmctld knows none of them: each read alone says so
        return answered_once(run, {tuple(show_job_argv(scontrol, job_id)): error for job_id in ids})
    try:
        records = job_records(text, "squeue --json")
    except CommandFailed:
        return run  # unreadable: each job is read alone
    wanted = set(ids)
    for record in records[:MAX_RECORDS_SHOWN]:
        job_id = str(record.get("job_id")) if isinstance(record, dict) else None
        # As `scontrol --json show job ID` would show it (parse_job_json picks it by its id). A record
        # without the fields the callers read is not taken for one: a write from a record without
        # its AdminComment would drop what is there, an adoption without gres_detail would see no GPUs.
        if job_id in wanted and isinstance(record.get("admin_comment"), str) and isinstance(record.get("gres_detail"), list):
            answers.setdefault(tuple(show_job_argv(scontrol, job_id)), json.dumps({"jobs": [record]}))
    return answered_once(run, answers)


def answered_once(run: RunCommand, answers: dict) -> RunCommand:
    """``run``, but each command of ``answers`` (argv tuple -> its output, or the CommandFailed it
    raised) is answered from there the first time it is asked, then run again if asked again."""
    unread = dict(answers)

    def call(argv, *args, **kwargs):
        answer = unread.pop(tuple(argv), None)
        if answer is None:
            return run(argv, *args, **kwargs)
        if isinstance(answer, CommandFailed):
            raise answer
        return answer

    return call


def running_jobs_argv(squeue: str, node: str) -> list[str]:
    return [squeue, "--noheader", "--nodelist", node, "--states", "RUNNING,CONFIGURING,COMPLETING,SUSPENDED", "--format", "%A"]


def admin_comment_argv(scontrol: str, job_id: str, text: str) -> list[str]:
    """``job_id``: an id, ARRAY_TASK or HETJOB+OFFSET (update_target)."""
    if not re.fullmatch(r"[0-9]{1,12}(?:_[0-9]{1,10}|\+[0-9]{1,6})?", job_id):
        raise ValueError(f"job {job_id!r}: not a job id, ARRAY_TASK or HETJOB+OFFSET")
    return [scontrol, "update", f"job={job_id}", f"AdminComment={text}"]


_GRES_IDX = re.compile(r"gpu(?::[^:(]+)?:[0-9]+\(IDX:([0-9,\-]*)\)")
MAX_GRES_DETAIL_CHARS = 64 << 10


def slurm_gpus_on_only_node(job: dict) -> tuple[int, ...] | None:
    """The GPU indices Slurm gave a one-node job, from `gres_detail` (e.g. ``gpu:2(IDX:0-1)``), sorted.

    None when Slurm's per-node list cannot be known from the record: the job spans several nodes
    (its per-node list would need the host list expanded), or the detail is missing, not a string
    or not in Slurm's form. An empty tuple for a job without GPUs. ValueError (as
    :func:`parse_gpu_indices`) when the detail is in Slurm's form but its index list is out of
    bounds (an index above MAX_GPU_INDEX, a huge range, a backwards range); nothing else.
    """
    detail = job.get("gres_detail") if isinstance(job, dict) else None
    if not isinstance(detail, list) or len(detail) > 1:
        return None
    if not detail:
        return ()
    if not isinstance(detail[0], str) or len(detail[0]) > MAX_GRES_DETAIL_CHARS:
        return None
    gpus: list[int] = []
    for part in re.split(r",(?=gpu)", detail[0]):
        match = _GRES_IDX.fullmatch(part.strip())
        if match is None:
            return None
        gpus.extend(parse_gpu_indices(match.group(1)))
        if len(gpus) > MAX_GPU_INDEX + 1:
            raise ValueError(f"gres_detail {detail[0][:60]!r} names more than {MAX_GPU_INDEX + 1} GPUs ({_ACCEPTED_GPUS})")
    return tuple(sorted(set(gpus)))


# --- node features (slurm.conf Features=, scontrol update ... ActiveFeatures=) -------------------

_FEATURE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_FEATURES = 256


def is_feature_name(text: str) -> bool:
    """A node feature name Slurm and MAPA accept: letters, digits, '_', '.', '-', at most 64."""
    return _FEATURE.fullmatch(text) is not None


def show_node_argv(scontrol: str, node: str) -> list[str]:
    return [scontrol, "--oneliner", "show", "node", node]


def parse_available_features(text: str) -> tuple[str, ...]:
    """The ``AvailableFeatures=`` of `scontrol --oneliner show node NODE` (``(null)``: none).
    CommandFailed unless the output holds exactly one such token of plain feature names."""
    return _parse_node_features(text, "AvailableFeatures")


def parse_active_features(text: str) -> tuple[str, ...]:
    """The ``ActiveFeatures=`` of `scontrol --oneliner show node NODE`, in Slurm's order
    (``(null)``: none); an administrator may have made some available features inactive.
    CommandFailed unless the output holds exactly one such token of plain feature names."""
    return _parse_node_features(text, "ActiveFeatures")


def _parse_node_features(text: str, field: str) -> tuple[str, ...]:
    if len(text) > MAX_OUTPUT_BYTES:
        raise CommandFailed(f"scontrol printed {len(text)} characters for one node (accepted: at most {MAX_OUTPUT_BYTES})")
    key = field + "="
    values = [token[len(key):] for token in text.split() if token.startswith(key)]
    if len(values) != 1:
        raise CommandFailed(f"scontrol show node printed {len(values)} {key} fields (expected one): {text[:120]!r}")
    if values[0] in ("", "(null)"):
        return ()
    names = tuple(values[0].split(","))
    if len(names) > MAX_FEATURES or not all(map(is_feature_name, names)):
        raise CommandFailed(f"{key}{values[0][:120]!r} is not a list of feature names (accepted: at most {MAX_FEATURES} "
                            "names of letters, digits, '_', '.', '-', joined by ',')")
    return names


def active_features_argv(scontrol: str, node: str, features: tuple[str, ...], extra: str | None = None,
                         weight: int | None = None) -> list[str]:
    """`scontrol update NodeName=NODE ActiveFeatures=a,b [Extra=TEXT] [Weight=N]` (ValueError for a
    name Slurm would not take, an Extra with blanks, quotes or control characters, or a weight
    outside 1..2^31-1)."""
    if not all(map(is_feature_name, features)):
        raise ValueError(f"feature names {features!r} (accepted: letters, digits, '_', '.', '-')")
    argv = [scontrol, "update", f"NodeName={node}", f"ActiveFeatures={','.join(features)}"]
    if extra is not None:
        if not re.fullmatch(r"[A-Za-z0-9_.,:/@=-]{0,4096}", extra):
            raise ValueError(f"node Extra {extra[:80]!r} (accepted: up to 4096 letters, digits and _.,:/@=-)")
        argv.append(f"Extra={extra}")
    if weight is not None:
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 2**31 - 1:
            raise ValueError(f"node weight {weight!r} (accepted: a whole number 1..{2**31 - 1})")
        argv.append(f"Weight={weight}")
    return argv
