"""Run a command that stops when the process that started it dies: on Linux, set the calling
process's parent-death signal to SIGTERM (PR_SET_PDEATHSIG), then exec the command, which keeps
the setting. `Stack` starts every child this way, the nats-server included, so none outlives a
`jetserve up` (or a test) that was SIGKILLed. Elsewhere it only execs.

    python -m services.with_parent PARENT_PID COMMAND [ARG ...]

(A `preexec_fn` would do the same in one process, but it makes Python fork the whole parent,
threads and all, and a parent with gRPC's threads then aborted in the child.)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # prctl(2)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parent, command = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # it died before the line above: too late to be told
            sys.exit(0)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
