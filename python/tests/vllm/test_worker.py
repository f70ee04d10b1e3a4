"""kvferry.vllm.worker's lease backstop over a real producer rank (KvferryTransport, TCP on
127.0.0.1): it counts from the publish, where kvferry's lease starts, not from when the worker
took the send; a send freed by the backstop before its publish is never published. The
publish thread is held back by a task queued before the send (a publish backlog); the
backstop's clock is the test's own, so nothing waits on time."""

import importlib.util
import threading

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run scripts/vllm-tests.sh", allow_module_level=True)

from test_transport import caches, make
from kvferry.vllm.metadata import KvferryConnectorMetadata, SendOrder
from kvferry.vllm.worker import KvferryWorkerSide

LEASE = 5.0
BACKSTOP = LEASE + KvferryWorkerSide.LEASE_BACKSTOP_SECONDS


@pytest.fixture
def backlogged():
    """(worker, transport, clock, gate): a producer rank whose publish thread waits for ``gate``."""
    made = []

    def build(port):
        transport = make("p", caches(8, seed=1), port)
        gate = threading.Event()
        transport._publish_pool.submit(gate.wait, 30)
        clock = [1000.0]
        worker = KvferryWorkerSide(0, 0, 30.0, transport, clock=lambda: clock[0])
        made.append((worker, gate))
        return worker, transport, clock, gate

    yield build
    for worker, gate in made:
        gate.set()
        worker.shutdown()


def send(tid):
    return SendOrder(request_id="r-" + tid, transfer_id=tid, block_ids=((3, 0, 5),), num_tokens=75,
                    lease_seconds=LEASE, load_key="k-" + tid)


def drain(transport):
    """Returns once the publish thread ran everything queued so far."""
    transport._publish_pool.submit(lambda: None).result(timeout=30)


def test_the_backstop_counts_from_the_publish_not_from_start(backlogged):
    worker, transport, clock, gate = backlogged(17691)
    worker.start(KvferryConnectorMetadata(loads=[], sends=[send("late")]))
    clock[0] += 4.0  # the publish runs 4 s after the worker took the send
    gate.set()
    drain(transport)
    assert "late" in transport._published  # published, its kvferry lease runs
    clock[0] += BACKSTOP - 4.0 + 0.5  # past the backstop counted from start, not from the publish
    assert worker.get_finished() == (None, None)
    clock[0] += 4.0  # past the backstop counted from the publish
    assert worker.get_finished() == ({"r-late"}, None)


def test_a_send_freed_before_its_publish_is_not_published(backlogged):
    worker, transport, clock, gate = backlogged(17693)
    worker.start(KvferryConnectorMetadata(loads=[], sends=[send("stale")]))
    clock[0] += BACKSTOP + 0.5
    assert worker.get_finished() == ({"r-stale"}, None)  # vLLM frees (and may reuse) its blocks
    gate.set()
    drain(transport)
    assert "stale" not in transport._published
    # Not published, so never released again: the worker does not report it a second time.
    assert transport.released() == [] and worker.get_finished() == (None, None)
