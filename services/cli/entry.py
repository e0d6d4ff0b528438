"""The ``iserve`` command's entry point.

Loading the CLI's modules (gRPC, rich, redis, the generated stubs) takes a second or two
on a busy machine; a Ctrl-C in that time raised KeyboardInterrupt inside an import and
printed a 30-line traceback. Here it ends the command quietly with 130, as a Ctrl-C does
once the command runs (``services.cli.main.main``). At once, without unwinding: nothing
has started yet, and an exception raised inside an extension module's initialisation
(gRPC's) came out as an ImportError with a traceback and exit 1.
"""

from __future__ import annotations

import os
import signal
import sys

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C ended


def _interrupted(signum: int, frame: object) -> None:
    os._exit(INTERRUPTED)


def main() -> int:
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        from services.cli.main import main as run
    finally:
        signal.signal(signal.SIGINT, previous)
    return run()


if __name__ == "__main__":
    sys.exit(main())
