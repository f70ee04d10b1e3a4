"""The package as a newcomer meets it: its version, reprs in Python's terms, and the parts of
kvferry.vllm that import without vLLM (the proxy) with errors that say what to install."""

import importlib.metadata
import subprocess
import sys

import numpy as np
import pytest

import kvferry


def test_version_is_the_installed_distributions():
    assert kvferry.__version__ == importlib.metadata.version("kvferry")
    assert kvferry.__version__.count(".") == 2


def test_the_distribution_declares_numpy():
    requires = importlib.metadata.requires("kvferry") or []
    assert any(r.split(">")[0].split("=")[0].strip() == "numpy" for r in requires), requires


def pair():
    shape = (2, 4, 16, 2, 8)
    kv_p = np.random.default_rng(3).standard_normal(shape).astype(np.float16)
    kv_c = np.zeros(shape, dtype=np.float16)

    def rank(kv):
        layer = kvferry.KVCacheLayer("model.layers.0.self_attn.attn", kv, "KV B N H D")
        return kvferry.Rank([kvferry.KVCacheGroup(0, [layer])])

    return kvferry.Producer([rank(kv_p)]), kvferry.Consumer([rank(kv_c)]), kv_p, kv_c


def test_reprs_are_python_expressions_not_rusts():
    producer, consumer, _, _ = pair()
    try:
        info = producer.publish("req-'x'", [[0, 1]], 20)
        out = consumer.load("req-'x'", producer.endpoint, [[0, 1]], [[2, 3]], 20, load_key=info.load_key)
        bad = consumer.load("nope", producer.endpoint, [[0]], [[0]], 10, load_key="wrong", timeout=10)
        texts = [repr(info), repr(out), repr(bad), repr(producer), repr(consumer), repr(out.verdict),
                 repr(kvferry.KVChecksumPolicy(fail_closed=True, load_failure_policy="recompute"))]
        for t in texts:
            assert "Some(" not in t and "true" not in t and "false" not in t, t
            # Python quotes with ' unless the text holds one (the request id here).
            assert '"' not in t or t is texts[1], t
        assert repr(out) == ("LoadOutcome(\"req-'x'\", landed=True, verdict='verified', "
                             f"action='complete', bytes={out.bytes}, error=None)")
        assert "landed=False" in repr(bad) and "verdict=None" in repr(bad)
        assert f"error={bad.error!r}" in repr(bad)
        assert "warning=None" in repr(info) and "checksummed=True" in repr(info)
        assert "checksums=True" in repr(consumer)
        assert repr(out.verdict) == "KVChecksumVerdict('verified')"
    finally:
        producer.shutdown()


def run_py(code, tmp_path):
    # From a folder outside python/tests: there python/tests/vllm would pass for a vllm package.
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


def test_the_proxy_imports_and_shows_help_without_vllm(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kvferry.vllm.proxy", "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "--prefill" in p.stdout and "--decode" in p.stdout
    p = run_py("import sys, kvferry.vllm.proxy; print('vllm' in sys.modules)", tmp_path)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr


def test_a_missing_proxy_package_is_named_with_its_install_command(monkeypatch):
    from kvferry.vllm import proxy

    monkeypatch.setattr(proxy, "PROXY_PACKAGES", ("fastapi", "kvferry_no_such_package"))
    with pytest.raises(ImportError) as e:
        proxy.make_app("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert "pip install kvferry_no_such_package" in str(e.value) or \
        "pip install fastapi kvferry_no_such_package" in str(e.value)
    assert "kvferry[proxy]" in str(e.value)


def test_the_connector_without_vllm_says_what_to_install(tmp_path):
    p = run_py("import importlib.util; print(importlib.util.find_spec('vllm') is not None)", tmp_path)
    if p.stdout.strip() == "True":
        pytest.skip("vLLM is installed here")
    p = run_py("from kvferry.vllm import KvferryConnector", tmp_path)
    assert p.returncode != 0
    assert "ImportError" in p.stderr and "pip install vllm" in p.stderr, p.stderr
