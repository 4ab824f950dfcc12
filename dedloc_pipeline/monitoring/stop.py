"""When a process should stop: Ctrl-C, or SIGTERM and SIGHUP (what systemd, docker and a closed
terminal send), all alike: once, cleanly; twice, at once; or another thread asks."""

from __future__ import annotations

import signal
import threading

# the signals that mean "stop", where the platform has them
SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Interrupted(KeyboardInterrupt):
    """A stop signal taken as Ctrl-C; ``signum`` says which (the exit status is 128 + it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def name(signum: int | None) -> str:
    return "Ctrl-C" if signum in (None, signal.SIGINT) else signal.Signals(signum).name


def exit_status(exc: BaseException | int | None) -> int:
    """128 + the signal, as a shell reports a process it ended: 130 for Ctrl-C, 143 for SIGTERM."""
    signum = exc if isinstance(exc, int) else getattr(exc, "signum", None)
    return 128 + int(signal.SIGINT if signum is None else signum)


def as_interrupt() -> None:
    """From now on SIGTERM and SIGHUP raise KeyboardInterrupt (``Interrupted``) as SIGINT does, so
    every command that cleans up after Ctrl-C cleans up after them too. Only in the main thread;
    a signal set to be ignored (``nohup``) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        if s != signal.SIGINT and signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, _interrupt)


def _interrupt(signum, frame) -> None:
    if _in_finalizer(frame):  # raised here, Python would print it and go on: the signal lost
        main = threading.main_thread().ident
        threading.Timer(REDELIVER_S, signal.pthread_kill, (main, signum)).start()
        return
    raise Interrupted(signum)


REDELIVER_S = 0.01  # a signal that landed in a finalizer is sent again this much later


def _in_finalizer(frame) -> bool:
    """Whether ``frame`` runs inside a ``__del__`` (a garbage collection between two bytecodes of
    any code), where an exception is ignored. A SIGTERM taken there once left a scheduler running."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


class StopRequest:
    """When a worker should stop: a first stop signal lets the step under way finish (an upload
    completes, chunks then manifest), a second raises KeyboardInterrupt at once (an upload under
    way is abandoned before its manifest); or another thread sets ``event``. ``signum``: the
    first signal's.

    The handler only counts presses: setting an Event from a signal handler can deadlock on the
    Event's own lock. Outside the main thread nothing is installed, nor for a signal that is
    ignored.
    """

    def __init__(self, event: threading.Event | None = None):
        self.event = event
        self.presses = 0
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __call__(self) -> bool:
        return self.presses > 0 or (self.event is not None and self.event.is_set())

    def _pressed(self, signum, frame) -> None:
        self.presses += 1
        self.signum = self.signum or signum
        if self.presses > 1:
            self._restore()  # a third press is the usual KeyboardInterrupt
            raise Interrupted(signum)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                previous = signal.getsignal(s)
                if previous is not signal.SIG_IGN:
                    self._previous[s] = previous if previous is not None else (
                        signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
                    signal.signal(s, self._pressed)
        return self

    def _restore(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()
