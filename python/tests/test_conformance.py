"""Conformance: `conformance_script.py` run against Mooncake's non-CUDA wheel and against kvferry
must give the same outcome for every call.

Mooncake is installed from PyPI into a throwaway venv (`mooncake-transfer-engine-non-cuda`,
pinned to the version this table was checked against; override with
`KVFERRY_MOONCAKE_SPEC`, or point `KVFERRY_MOONCAKE_PYTHON` at an interpreter that already has
it). Its wheel needs `libibverbs.so.1` to import (`apt-get install libibverbs1`; a missing one
fails the test with that hint). PyPI unreachable: the Mooncake half is skipped with the reason;
`KVFERRY_SKIP_MOONCAKE=1` skips it on purpose. The kvferry half always runs.
"""

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "conformance_script.py"
MOONCAKE_SPEC = os.environ.get("KVFERRY_MOONCAKE_SPEC",
                               "mooncake-transfer-engine-non-cuda==0.3.13.post1")

# The outcome of every case, the same for both implementations unless DIFFERENCES says
# otherwise. Codes are Mooncake's: 0 ok, -1 failure / invalid argument, -3 not registered,
# -7 overlapping registration, -102 peer unreachable; async ids are compared as "nonzero".
EXPECTED = {
    "initialize": [0, 0],
    "initialize_non_p2p_metadata": -1,
    "rpc_port_is_port": True,
    "register": [0, 0],
    "register_overlap": -7,
    "register_zero_length": -1,
    "unregister_unknown": -3,
    "batch_unregister_unknown": -3,
    "send_probe": 0,
    "sync_write_1MiB": [0, True],
    "sync_read_1MiB": [0, True],
    "sync_write_zero_length": 0,
    "batch_write_empty": 0,
    "batch_write_with_a_zero_length_entry": [0, True],
    "batch_write_64x4KiB_scattered": [0, True],
    "batch_read_64x4KiB_scattered": [0, True],
    "async_write_batch": [True, 0, True],
    "async_read_and_write_two_batches": [True, True, 0, True],
    "submit_and_check": [True, 1, True],
    "threads_8": [[[0], True]] * 8,
    # sync, batch sync -> -1; async, submit -> id 0; send_probe -> -102 (ERR_SOCKET); all
    # within 5 s (a refused port fails in milliseconds on both)
    "unreachable_session": [[-1, -1, 0, 0, -102], True],
    "remote_out_of_range": [-1, -1, -1, "fail", "fail"],
    "lists_of_different_lengths": [-1, -1, 0],
    # register, write, bytes landed, unregister, write again, read again, untouched after
    "write_after_unregister": [0, 0, True, 0, -1, -1, True],
    "batch_register_round_trip": [0, -7, 0, -3],
    "unregister": [0, 0],
    # rc, bytes landed, call long enough to judge, the counting thread ran during the call
    "gil_released_during_transfer": [0, True, True, True],
}

# Where the two genuinely differ: each implementation's actual outcome, and why.
DIFFERENCES = {
    # Mooncake's TCP transport does not check that the local buffer of a request is
    # registered: it reads any address of the process (its RDMA transport would fail for lack
    # of an lkey). kvferry refuses a local range outside registered memory on every transport
    # (TransferError::NotRegistered), so nothing is sent.
    "local_buffer_not_registered": {"mooncake": [0, True], "kvferry": [-1, False]},
}


def expected(impl):
    e = dict(EXPECTED)
    for case, per_impl in DIFFERENCES.items():
        e[case] = per_impl[impl]
    return e


def run_script(python, impl):
    p = subprocess.run([str(python), str(SCRIPT), impl], capture_output=True, text=True,
                       timeout=600, cwd=HERE)
    assert p.returncode == 0, f"{impl} run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    import json
    return json.loads(p.stdout.strip().splitlines()[-1])


def check(impl, got):
    sigs = got.pop("signatures")
    want = expected(impl)
    assert sorted(got) == sorted(want), "cases differ from the table"
    bad = {c: (got[c], want[c]) for c in want if got[c] != want[c]}
    assert not bad, f"{impl}: case -> (got, expected): {bad}"
    return sigs


NETWORK_ERRORS = re.compile(
    r"NewConnectionError|ConnectionError|Temporary failure in name resolution|"
    r"Network is unreachable|No matching distribution found|Could not find a version",
    re.I)


@pytest.fixture(scope="session")
def mooncake_python(tmp_path_factory):
    if os.environ.get("KVFERRY_SKIP_MOONCAKE") == "1":
        pytest.skip("KVFERRY_SKIP_MOONCAKE=1: Mooncake half skipped on purpose")
    given = os.environ.get("KVFERRY_MOONCAKE_PYTHON")
    if given:
        python = Path(given)
    else:
        d = tmp_path_factory.mktemp("mooncake-venv")
        venv.EnvBuilder(with_pip=True).create(d)
        python = d / "bin" / "python"
        p = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                            MOONCAKE_SPEC, "numpy"], capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            out = p.stdout + p.stderr
            if NETWORK_ERRORS.search(out):
                pytest.skip(f"PyPI unreachable, cannot install {MOONCAKE_SPEC}: {out[-400:]}")
            pytest.fail(f"pip install {MOONCAKE_SPEC} failed:\n{out[-3000:]}")
    p = subprocess.run([str(python), "-c", "import mooncake.engine"], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        hint = (" (install it: apt-get install -y libibverbs1)"
                if "libibverbs" in p.stderr else "")
        pytest.fail(f"Mooncake's wheel does not import{hint}:\n{p.stderr[-2000:]}")
    return python


@pytest.fixture(scope="session")
def kvferry_outcome():
    return run_script(sys.executable, "kvferry")


def test_kvferry_matches_the_table(kvferry_outcome):
    check("kvferry", dict(kvferry_outcome))


def test_mooncake_matches_the_same_table(mooncake_python, kvferry_outcome):
    """The same script under Mooncake: the same outcome for every case (DIFFERENCES aside), and
    the same method signatures (names, order, defaults; Mooncake's unnamed pybind11 arguments
    match any name)."""
    mc = run_script(mooncake_python, "mooncake")
    mc_sigs = check("mooncake", mc)
    kv_sigs = dict(kvferry_outcome)["signatures"]
    assert sorted(mc_sigs) == sorted(kv_sigs)
    for m, params in mc_sigs.items():
        ours = kv_sigs[m]
        assert len(ours) == len(params), f"{m}: {ours} vs Mooncake {params}"
        for (mn, md), (kn, kd) in zip(params, ours):
            assert md == kd, f"{m}: default of {kn} is {kd}, Mooncake's {md}"
            assert mn in ("_", kn), f"{m}: parameter {kn}, Mooncake calls it {mn}"
