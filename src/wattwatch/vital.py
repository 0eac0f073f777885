"""A worker thread that dies takes its process down, loudly, instead of leaving a process that looks up and
measures or stores nothing.

Every thread of the agent and the collector is a loop that catches what it expects. Anything else used to
end the thread alone: the process stayed up, answered /healthz, ignored SIGTERM or stored nothing.
``ThreadDeaths.install`` hooks ``threading.excepthook`` for the whole process (there is one hook per
process, hence one ``DEATHS``): a thread's uncaught exception is logged in one line, the thread is listed
as dead (``/healthz`` answers 503 naming it from then on), and the service's stop event is set, so it
stops as on SIGTERM and then exits 1 with one line saying which thread died (``finish``).
"""

from __future__ import annotations

import logging
import threading

from wattwatch.cli.errors import RuntimeFailure

log = logging.getLogger(__name__)


class ThreadDeaths:
    """The threads of this process that died of an uncaught exception, and what killed them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dead: dict[str, str] = {}
        self._previous = threading.excepthook

    @property
    def dead(self) -> list[str]:
        """Names of the threads that died, in order."""
        with self._lock:
            return list(self._dead)

    def install(self, stop: threading.Event) -> None:
        """From now on (until ``finish``) a thread's uncaught exception is recorded and sets ``stop``."""
        with self._lock:
            self._dead.clear()
        self._previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            if args.exc_type is SystemExit:
                return
            name = args.thread.name if args.thread is not None else "unnamed"
            why = f"{args.exc_type.__name__}: {args.exc_value}"
            with self._lock:
                self._dead[name] = why
            log.error("thread %s died (%s); stopping the process so its supervisor restarts it", name, why)
            if args.exc_value is not None:
                log.debug("thread %s's traceback", name, exc_info=args.exc_value)
            stop.set()

        threading.excepthook = hook

    def finish(self) -> None:
        """Put back the hook ``install`` replaced; RuntimeFailure (exit 1, one line) if a thread died: for a
        service to call once it has stopped."""
        threading.excepthook = self._previous
        with self._lock:
            if not self._dead:
                return
            name, why = next(iter(self._dead.items()))
            self._dead.clear()  # said now; a later service in this process starts clean
        raise RuntimeFailure(
            f"thread {name} died ({why}); the process stopped rather than run without it. Rerun with "
            "--log-level debug for its traceback and report it"
        )


DEATHS = ThreadDeaths()
