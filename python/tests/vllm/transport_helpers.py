"""Helpers shared by the transport-level tests (test_transport.py, test_transport_pp.py)."""

import time


def released_soon(producer, within: float = 10.0):
    """``producer.released()`` once it says something, or its empty answer after ``within``
    seconds (kvferry releases a served lease before the consumer's load returns, docs/design.md
    §4.3: the first call normally has it)."""
    end = time.monotonic() + within
    while True:
        out = producer.released()
        if out or time.monotonic() > end:
            return out
        time.sleep(0.05)
