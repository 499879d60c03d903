"""The Prolog's wall-time budget: every wait and every Slurm call is cut to what is left, a
reserve is kept for the last commit under the lock, and a search runs with a deadline (and at
most a few at once in mapa-agent)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Sequence

from ..text.commands import CommandFailed, RunCommand, Runner

COMMIT_RESERVE_S = 1.0  # kept back for the last commit under the lock


class Budget:
    """The Prolog's wall-time budget: every wait and every Slurm call is cut to what is left."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.deadline = clock() + seconds

    def left(self) -> float:
        return self.deadline - self.clock()

    def for_step(self, wanted: float) -> float:
        """At most ``wanted`` seconds, never eating into the commit reserve (may be <= 0)."""
        return min(wanted, self.left() - COMMIT_RESERVE_S)


def within_budget(run: RunCommand, budget: Budget, command_timeout: float) -> RunCommand:
    """``run`` with each call's timeout cut to the budget; refuses to start once it is spent."""

    def call(argv: Sequence[str]) -> str:
        timeout = budget.for_step(command_timeout)
        if timeout < 0.05:
            raise CommandFailed(f"{os.path.basename(argv[0])} not run: the Prolog's time budget is spent")
        if isinstance(run, Runner):
            return run(argv, timeout=timeout)
        return run(argv)

    return call


def run_for_at_most(seconds: float, work: Callable[[], Any], when_done: Callable[[], None] = lambda: None) -> Any:
    """``work()``'s result, or TimeoutError after ``seconds`` (the work is left to finish alone).
    ``when_done`` runs once the work has ended, whenever that is (also if it never started)."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            outcome.append((False, error))
        finally:
            when_done()

    thread = threading.Thread(target=target, daemon=True)
    try:
        thread.start()
    except BaseException:
        when_done()
        raise
    thread.join(max(seconds, 0.0))
    if not outcome:
        raise TimeoutError(f"did not finish within {max(seconds, 0.0):.1f} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


# A search left behind by a Prolog whose budget ran out runs on until it ends (a Python thread
# cannot be stopped). In mapa-agent, many of them would starve every other thread of the
# interpreter, Prologs holding the ledger's lock included (a 64-GPU soak saw answers take 25 s):
# so at most this many searches run at once, and a Prolog that cannot get a slot within its
# budget keeps its provisional choice.
MAX_CONCURRENT_SEARCHES = 2
_search_slots = threading.BoundedSemaphore(MAX_CONCURRENT_SEARCHES)


def search_within(seconds: float, work: Callable[[], Any], slots: threading.BoundedSemaphore | None = None) -> Any:
    """``work()``'s result, run in a search slot within ``seconds``; TimeoutError otherwise (the
    work, once started, finishes alone and then frees its slot)."""
    slots = slots or _search_slots
    deadline = time.monotonic() + max(seconds, 0.0)
    if not slots.acquire(timeout=max(seconds, 0.0)):
        raise TimeoutError("searches of earlier jobs still run, and no slot came free within the Prolog's budget")
    try:
        return run_for_at_most(deadline - time.monotonic(), work, when_done=slots.release)
    except TimeoutError:
        raise TimeoutError("the search did not finish within the Prolog's budget") from None


