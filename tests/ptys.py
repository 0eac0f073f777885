"""A real process on a pseudo-terminal, as a user's shell starts it: its own session with the pty as its
controlling terminal, so writing Ctrl-C (``\\x03``) to the pty sends it SIGINT through the terminal
driver. Reads wait on conditions with deadlines, never on sleeps."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import struct
import termios
import time
from collections.abc import Mapping, Sequence


class PtyProcess:
    """``argv`` run on a new pty of ``columns`` x ``rows``; everything it writes is kept in ``text``."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], *, columns: int = 200, rows: int = 50) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: pty.fork made it a session leader with the pty as its terminal
            try:
                # As at a terminal: Ctrl-C interrupts, even where the tests were started in the background
                # (a shell without job control starts background commands with SIGINT ignored).
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.execvpe(argv[0], list(argv), dict(env))
            finally:
                os._exit(127)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.text = ""
        self.returncode: int | None = None

    def _read(self, timeout_s: float) -> bool:
        """Read what is there within ``timeout_s``; False at end of output (the process closed the pty)."""
        ready, _, _ = select.select([self.fd], [], [], max(timeout_s, 0.0))
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: every process holding the pty's other end is gone
            return False
        if not data:
            return False
        self.text += data.decode(errors="replace")
        return True

    def read_until(self, pattern: str, timeout_s: float, *, start: int = 0) -> re.Match[str]:
        """Read until ``pattern`` matches the output from offset ``start``; fail with the output so far."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while True:
            found = regex.search(self.text, start)
            if found:
                return found
            left = deadline - time.monotonic()
            if left <= 0 or not self._read(min(left, 0.5)):
                found = regex.search(self.text, start)
                if found:
                    return found
                raise AssertionError(f"no {pattern!r} within {timeout_s} s; output so far:\n{self.text[-4000:]!r}")

    def ctrl_c(self) -> None:
        """Type Ctrl-C on the terminal."""
        os.write(self.fd, b"\x03")

    def wait(self, timeout_s: float) -> int:
        """Drain the output until the process exits (within ``timeout_s``); its exit status."""
        deadline = time.monotonic() + timeout_s
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout_s} s; output so far:\n{self.text[-4000:]!r}")
            self._read(0.05)
        while self._read(0.0) and select.select([self.fd], [], [], 0)[0]:
            pass
        return self.returncode

    def close(self) -> None:
        """Kill the process if it still runs and release the pty."""
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)
