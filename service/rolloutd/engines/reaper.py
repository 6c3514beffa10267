"""A watchdog process that ends engine processes when the service dies without stopping them.

vLLM starts its engine core as a child process (and the engine core starts workers). When the
service exits normally it shuts them down; when it is killed with SIGKILL, vLLM 0.32 leaves the
engine core and its workers running forever, holding memory (and GPUs). The kernel cannot help
portably: ``PR_SET_PDEATHSIG`` must be set inside the child after fork (or after exec under the
spawn start method) and is tied to the thread that forked it, none of which vLLM lets us hook.

So the service starts this small process first (``python -m rolloutd.engines.reaper PARENT_PID``)
and writes ``watch PID`` lines to its stdin as engine processes appear. The reaper polls its parent;
when the parent is gone it sends SIGTERM to every watched process and its descendants (vLLM shuts
down cleanly on SIGTERM, releasing shared memory), waits ``--grace`` seconds, then SIGKILLs what is
left. A clean stop writes ``exit``. The reaper runs in its own session, so a terminal's Ctrl-C or a
signal to the service's process group does not take it down before it has done its work.
A start that fails half-way writes ``reap``: the watched processes are ended at once.

Processes are tracked as :class:`psutil.Process` objects, which remember their start time, so a
recycled PID is never signalled.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import sys
import time

import psutil

logger = logging.getLogger(__name__)

POLL_S = 0.2
"""How often the parent's liveness and the watched process tree are checked."""


class Reaper:
    """Watches one parent; owns the set of engine processes to end if that parent dies.

    Invariant: ``_tree`` holds, as of the last poll, every watched process and all of its
    descendants. It is refreshed on every poll because once a watched process dies its children
    are re-parented and can no longer be found from it.
    """

    def __init__(self, parent_pid: int, grace_s: float) -> None:
        self.parent_pid = parent_pid
        self._grace_s = grace_s
        self._roots: list[psutil.Process] = []
        self._tree: dict[int, psutil.Process] = {}

    def parent_alive(self) -> bool:
        return os.getppid() == self.parent_pid

    def watch(self, pid: int) -> None:
        try:
            self._roots.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            logger.debug("reaper: pid %d exited before it was watched", pid)
        self.refresh()

    def refresh(self) -> None:
        tree: dict[int, psutil.Process] = {}
        for root in self._roots:
            try:
                if not root.is_running():
                    continue
                tree[root.pid] = root
                for child in root.children(recursive=True):
                    tree[child.pid] = child
            except psutil.NoSuchProcess:
                continue
        if tree.keys() != self._tree.keys():
            logger.debug("reaper: watching %d processes: %s", len(tree), sorted(tree))
        self._tree = tree

    def reap(self) -> tuple[int, int]:
        """Terminate the watched tree, then kill what outlives the grace period.

        Returns how many processes were running and how many of them had to be killed.
        """
        procs = [p for p in self._tree.values() if p.is_running()]
        for proc in procs:
            _signal(proc, kill=False)
        _, alive = psutil.wait_procs(procs, timeout=self._grace_s)
        for proc in alive:
            _signal(proc, kill=True)
        psutil.wait_procs(alive, timeout=self._grace_s)
        return len(procs), len(alive)


def _signal(proc: psutil.Process, *, kill: bool) -> None:
    try:
        if kill:
            proc.kill()
        else:
            proc.terminate()
    except psutil.NoSuchProcess:
        return


class _Commands:
    """Newline-separated commands from a pipe, read without blocking past one poll interval."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buffer = b""
        self._closed = False

    def poll(self, timeout_s: float) -> list[tuple[str, str]]:
        if self._closed:
            # Every writer is gone; the parent check alone decides what happens next.
            time.sleep(timeout_s)
            return []
        if not select.select([self._fd], [], [], timeout_s)[0]:
            return []
        chunk = os.read(self._fd, 4096)
        self._closed = not chunk
        *lines, self._buffer = (self._buffer + chunk).split(b"\n")
        commands = []
        for line in lines:
            verb, _, arg = line.decode().strip().partition(" ")
            commands.append((verb, arg))
        return commands


def run(reaper: Reaper, commands_fd: int) -> int:
    """Serve ``watch PID`` / ``exit`` / ``reap`` commands until the parent dies (then reap) or says
    exit or reap."""
    commands = _Commands(commands_fd)
    while reaper.parent_alive():
        for verb, arg in commands.poll(POLL_S):
            if verb == "watch":
                reaper.watch(int(arg))
            elif verb == "exit":
                return 0
            elif verb == "reap":
                reaper.refresh()
                running, killed = reaper.reap()
                logger.info(
                    "reaper: ended %d engine processes (%d needed SIGKILL)", running, killed
                )
                return 0
            elif verb:
                logger.error("reaper: ignoring unknown command %r", verb)
        reaper.refresh()
    running, killed = reaper.reap()
    logger.warning(
        "reaper: parent %d died; ended %d engine processes (%d needed SIGKILL)",
        reaper.parent_pid,
        running,
        killed,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parent_pid", type=int)
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between TERM and KILL")
    parser.add_argument(
        "--log-level", default="INFO", help="DEBUG also logs each change of the watched tree"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s")
    return run(Reaper(args.parent_pid, args.grace), sys.stdin.fileno())


if __name__ == "__main__":
    sys.exit(main())
