"""What the benchmarks' optional parts need, and a one-line hint that installs it when it is missing."""

from __future__ import annotations

import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pyplot(program: str):
    """matplotlib.pyplot on the Agg backend; without matplotlib, one line on stderr and exit status 2."""
    try:
        import matplotlib
    except ImportError:
        python = shlex.quote(sys.executable or "python3")
        print(f"{program} needs matplotlib, which comes with the plot extra: "
              f"{python} -m pip install -e {shlex.quote(ROOT + '[plot]')} "
              f"(or, for the system's Python, Debian's python3-matplotlib: apt install python3-matplotlib)", file=sys.stderr)
        raise SystemExit(2) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mini_cluster(program: str, container: str) -> None:
    """Returns when the mini cluster's ``container`` runs; else one line on stderr and exit status 2
    (issue 52: the cluster benchmarks ended in a traceback from their first `docker exec`)."""
    import shutil
    import subprocess

    why = ""
    if shutil.which("docker") is None:
        why = "docker is not on PATH"
    else:
        try:
            state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", container],
                                   capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as error:
            why = f"docker did not answer ({error})"
        else:
            if state.stdout.strip() != "true":
                why = f"container {container} is not running"
    if why:
        print(f"{program}: error: needs the mini cluster: scripts/cluster up ({why})", file=sys.stderr)
        raise SystemExit(2)
