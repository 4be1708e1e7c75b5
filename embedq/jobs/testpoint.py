"""Named points of a job where a test interrupts it, as a user's Ctrl-C would.

With ``EMBEDQ_TEST_SIGINT_AT=<point>`` set, :func:`reached` raises SIGINT in the calling
(main) thread the first time the job gets to ``<point>``; Python turns it into a
KeyboardInterrupt right there. So an interruption test hits the same stage of the job
on every machine and under any load, which a count of writes made by the writer
thread does not. Unset (always, outside tests) :func:`reached` does nothing.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "EMBEDQ_TEST_SIGINT_AT"
POINTS = {
    "stream": "the first chunk is quantized; the overlay is still a partial file",
    "committing": "in place: the overlay has its final name, config.json is not edited yet",
    "derived-staged": "--output: the staging folder is complete, not yet renamed to the output",
}
_fired: set[str] = set()


def reached(point: str) -> None:
    """Interrupt here if the test environment names ``point`` (once per process)."""
    at = os.environ.get(ENV)
    if not at:
        return
    if at not in POINTS or point not in POINTS:  # a typo would make the test pass vacuously
        raise RuntimeError(f"{ENV}={at!r}: points are {', '.join(POINTS)}")
    if at != point or point in _fired:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"testpoint {point!r} reached off the main thread; SIGINT would be deferred")
    _fired.add(point)
    signal.raise_signal(signal.SIGINT)
