"""Producer.shutdown while a publish runs on another thread: both return (no GIL deadlock).

The publish waits without the GIL; shutdown is called with the GIL held. Before the fix the
publish held the producer's lock across its wait and shutdown took that lock with the GIL held,
so each waited for the other forever. Run in a child process so a hang fails the test by its
timeout instead of hanging the suite.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {tests!r})
    import kvferry
    from test_p2p import make_rank
    # Large enough that the publish's checksum is still running when shutdown is called.
    rank, _ = make_rank(0, 1, 65536, seed=None)
    producer = kvferry.Producer([rank])
    outcome = []
    def publish():
        try:
            producer.publish("r", [list(range(65536))], 65536 * 16)
            outcome.append("published")
        except RuntimeError as e:
            outcome.append("refused: %s" % e)
    t = threading.Thread(target=publish)
    t.start()
    time.sleep(0.02)
    producer.shutdown(timeout=60.0)
    t.join(60)
    print("publish:", outcome, "alive:", t.is_alive())
    sys.exit(0 if outcome and not t.is_alive() else 1)
""")


def test_shutdown_during_a_publish_returns():
    code = CHILD.format(tests=str(Path(__file__).parent))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
