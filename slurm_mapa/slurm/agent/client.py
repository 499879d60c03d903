"""The hooks' fast path: hand the Prolog or Epilog to the node's resident ``mapa-agent``.

Slurm starts the Prolog for every job, and starting Python with the engine costs more than the
decision itself. So the hook wrapper first runs this file,

    /usr/bin/python3 -I -S .../slurm_mapa/slurm/agent/client.py prolog   (or epilog)

which imports nothing but built-in modules (about 15 ms), sends the job's few SLURM_* variables
to the agent over a root-only Unix socket and waits for it to finish the hook. Exit status 0: the
agent did the hook. Exit status 3: there is no agent, it refused or it failed: the wrapper then
runs the hook in-process (the slow path, same code). Nothing here may import the package.

The protocol (version 1): the client sends ``MAPA1 <kind> <length>\\n`` and then ``length`` bytes of
``KEY=VALUE`` pairs separated by NUL bytes (environment values cannot hold NUL); the agent answers
one line, ``done`` or ``error <why>`` (``error busy`` when it runs too many requests already). The client keeps its end open until it has the answer, so
the agent can tell that a killed client no longer wants its decision.

The TaskProlog, as the job's user, runs ``client.py isolate SOCKET`` to have its task's GPU
devices isolated (slurm/isolation/), on a second socket anyone may use, which takes only this
kind. The agent answers ``done <state> <detail>`` (state: cgroup-v1, cgroup-v2, off, failed-open)
or ``error <why>`` (isolation = "fail-closed" and it failed). The client prints
``export MAPA_ISOLATION=<state>`` for the TaskProlog and exits 0; when refused, a ``print`` line
(Slurm shows it in the task's output) and exit status 1; 3 when there was no answer: the agent
could not be asked, did not answer in time, or stayed busy (``error busy``, or its listen backlog
full) until the deadline. The task waits ISOLATE_TIMEOUT_S at most for all of it, retries
included. The SPANK plugin (data/spank/spank_mapa_isolate.c) gives each case the same meaning.
"""

import errno
import os
import sys
import time

import _socket

# Not under /run/slurm-mapa: that holds the per-job files the TaskProlog reads as the job's user.
DEFAULT_SOCKET = "/run/slurm-mapa-agent/agent.sock"
KINDS = ("prolog", "epilog")
# Only what the hooks read from slurmd's environment travels; everything else stays out.
KEYS = ("SLURM_JOB_ID", "SLURMD_NODENAME", "SLURM_JOB_GPUS", "SLURM_JOB_COMMENT", "SLURM_JOB_NUM_NODES", "SLURM_JOB_SLUID")
MAX_VALUE_BYTES = 8192
MAX_REQUEST_BYTES = len(KEYS) * (MAX_VALUE_BYTES + 64)
MAX_HEADER_BYTES = 64
# The agent answers within the Prolog's configured wall-time budget (prolog_budget, at most
# config.MAX_PROLOG_BUDGET_S); past this the client gives up and the wrapper runs the hook
# in-process, which has the same budget. Worst case about 25 s + the budget, inside the 60 s+
# PrologEpilogTimeout the docs recommend (slurmd drains the node past it).
ANSWER_TIMEOUT_S = 25.0
CONNECT_TIMEOUT_S = 2.0
FALL_BACK = 3
# Anyone may connect here (the directory is 755, the socket 666): it takes isolate requests only.
ISOLATE_SOCKET = "/run/slurm-mapa-isolate/isolate.sock"
ISOLATE = "isolate"
PING = "ping"  # root only, no payload: "done ping" from a live agent, nothing run or logged (mapa doctor)
# The job id is only checked against the task's cgroup; the step's GPUs narrow within the job.
# MAPA_STEP_ENV=1: sent by the SPANK plugin (root) with the step's SLURM_STEP_GPUS, or without it
# for a step of no GPUs; believed only from root. MAPA_SPANK_CLAIM=1: sent by a TaskProlog whose
# environment says the SPANK plugin isolated the task while no record of the agent's says so
# (isolation/task_records.py); it decides nothing, the agent logs it.
ISOLATE_KEYS = ("SLURM_JOB_ID", "SLURM_STEP_GPUS", "MAPA_STEP_ENV", "MAPA_SPANK_CLAIM")
ISOLATE_TIMEOUT_S = 10.0  # the task waits this long at most, retries included; isolation takes milliseconds
BUSY = "error busy"
# Busy is asked again after a pause that doubles from the first to the most (as in the SPANK plugin).
FIRST_BUSY_BACKOFF_S = 0.01
MAX_BUSY_BACKOFF_S = 0.25
REFUSED = 1
# What _ask returns when the agent's listen backlog is full: a non-blocking connect's EAGAIN.
BACKLOG_FULL = object()


def request_bytes(kind, env):
    """The request for hook ``kind`` carrying the whitelisted variables of ``env``."""
    if kind not in KINDS + (ISOLATE,):
        raise ValueError("hook kind must be one of " + ", ".join(KINDS + (ISOLATE,)))
    pairs = []
    for key in ISOLATE_KEYS if kind == ISOLATE else KEYS:
        value = env.get(key)
        if value is None:
            continue
        encoded = value.encode("utf-8", "surrogateescape")[:MAX_VALUE_BYTES]
        pairs.append(key.encode() + b"=" + encoded.replace(b"\0", b""))
    payload = b"\0".join(pairs)
    return ("MAPA1 %s %d\n" % (kind, len(payload))).encode() + payload


def _left(deadline, longest):
    """Seconds to wait for the next step: ``longest``, or less when ``deadline`` comes first."""
    if deadline is None:
        return longest
    return min(longest, deadline - time.monotonic())


def _ask(request, path, answer_timeout, deadline=None):
    """One request; its answer line, None, or BACKLOG_FULL. The connect and the send wait
    CONNECT_TIMEOUT_S at most, each read ``answer_timeout``; with ``deadline`` (time.monotonic())
    nothing waits past it."""
    def wait_at_most(longest):
        left = _left(deadline, longest)
        if left <= 0:
            raise TimeoutError("past the deadline")
        sock.settimeout(left)

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    answer = b""
    try:
        # A timeout makes the socket non-blocking: on a full listen backlog the connect fails at
        # once with EAGAIN (a blocking one would wait for an accept); the other waits are polls.
        wait_at_most(CONNECT_TIMEOUT_S)
        try:
            sock.connect(path)
        except BlockingIOError as error:
            if error.errno == errno.EAGAIN:
                return BACKLOG_FULL
            raise
        if deadline is not None:  # sendall's timeout bounds it whole (Python 3.5+)
            wait_at_most(CONNECT_TIMEOUT_S)
        sock.sendall(request)
        while b"\n" not in answer and len(answer) < 4096:
            wait_at_most(answer_timeout)
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    except OSError:
        return None
    finally:
        sock.close()
    if b"\n" not in answer:
        return None
    return answer.split(b"\n", 1)[0].decode("utf-8", "replace")


def ask_agent(kind, env, path=DEFAULT_SOCKET, timeout=ANSWER_TIMEOUT_S):
    """The agent's answer line, or None when it could not be asked or did not answer."""
    answer = _ask(request_bytes(kind, env), path, timeout)
    return None if answer is BACKLOG_FULL else answer


def isolate(path, env=os.environ, *, timeout=None):
    """Ask for the task's isolation; (exit status, line for the TaskProlog's output or None).

    All of it, the asks again when the agent is busy included, ends within ``timeout`` seconds
    (ISOLATE_TIMEOUT_S by default)."""
    deadline = time.monotonic() + (ISOLATE_TIMEOUT_S if timeout is None else timeout)
    request = request_bytes(ISOLATE, env)
    backoff = FIRST_BUSY_BACKOFF_S
    while True:
        answer = _ask(request, path, ISOLATE_TIMEOUT_S, deadline)
        if answer is not BACKLOG_FULL and answer != BUSY:
            break
        if time.monotonic() + backoff >= deadline:
            answer = None  # busy until the deadline
            break
        time.sleep(backoff)
        backoff = min(backoff * 2, MAX_BUSY_BACKOFF_S)
    if answer is None:
        return FALL_BACK, None
    words = answer.split(" ", 3)
    if words[0] == "done" and len(words) > 1 and words[1] in ("cgroup-v1", "cgroup-v2", "off", "failed-open"):
        line = "export MAPA_ISOLATION=" + words[1]
        # What the task may open (MAPA's indices), so that the TaskProlog numbers its GPUs as CUDA does.
        if words[1].startswith("cgroup-") and len(words) > 2 and words[2].startswith("gpus="):
            opened = words[2][len("gpus="):]
            if opened == "none" or all(part.isdigit() and len(part) <= 4 for part in opened.split(",")):
                line += "\nexport MAPA_ISOLATED_GPUS=" + ("" if opened == "none" else opened)
        return 0, line
    # Slurm reads the TaskProlog's stdout and stderr together; a "print" line reaches the task's output.
    return REFUSED, "print mapa: GPU isolation failed, the task does not start: " + answer[:500]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) in (1, 2) and argv[0] == ISOLATE:
        status, line = isolate(argv[1] if len(argv) == 2 else ISOLATE_SOCKET)
        if line:
            sys.stdout.write(line + "\n")
        return status
    if len(argv) != 1 or argv[0] not in KINDS:
        sys.stderr.write("usage: client.py prolog|epilog|isolate [SOCKET]\n")
        return FALL_BACK
    answer = ask_agent(argv[0], os.environ, os.environ.get("MAPA_AGENT_SOCKET") or DEFAULT_SOCKET)
    return 0 if answer == "done" else FALL_BACK


if __name__ == "__main__":
    sys.exit(main())
