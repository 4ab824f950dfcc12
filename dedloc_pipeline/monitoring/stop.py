"""When a volunteer's worker should stop: Ctrl-C (once: cleanly, twice: at once), or another thread."""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """When a worker should stop: a first Ctrl-C lets the step under way finish (an upload
    completes, chunks then manifest), a second raises KeyboardInterrupt at once (an upload under
    way is abandoned before its manifest); or another thread sets ``event``.

    The handler only counts presses: setting an Event from a signal handler can deadlock on the
    Event's own lock. Outside the main thread, or where SIGINT is ignored, nothing is installed.
    """

    def __init__(self, event: threading.Event | None = None):
        self.event = event
        self.presses = 0
        self._previous = None

    def __call__(self) -> bool:
        return self.presses > 0 or (self.event is not None and self.event.is_set())

    def _pressed(self, signum, frame) -> None:
        self.presses += 1
        if self.presses > 1:
            signal.signal(signal.SIGINT, self._previous)  # a third press is the usual KeyboardInterrupt
            raise KeyboardInterrupt

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not signal.SIG_IGN:
                self._previous = previous if previous is not None else signal.default_int_handler
                signal.signal(signal.SIGINT, self._pressed)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

