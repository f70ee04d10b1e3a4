"""kvferry.Verdict / Action / Release: enums that are still the strings kvferry returns."""

import kvferry
from kvferry import Action, Release, Verdict


def test_members_are_the_strings_returned_before():
    assert [v.value for v in Verdict] == ["verified", "mismatch", "unverified"]
    assert [a.value for a in Action] == ["complete", "fail", "recompute"]
    assert Verdict.UNVERIFIED == "unverified" and "recompute" == Action.RECOMPUTE
    assert {"served": 1}[Release.SERVED] == 1  # hashes as the string
    assert Verdict("mismatch") is Verdict.MISMATCH


def test_str_and_format_are_the_value():
    # Python 3.12 formats a (str, Enum) mixin as "Verdict.VERIFIED"; log lines and reasons must
    # keep the plain word.
    assert str(Verdict.VERIFIED) == "verified"
    assert f"{Action.FAIL}" == "fail" and "%s" % Release.EXPIRED == "expired"


def test_release_reasons_classify_and_build():
    assert Release.of("served") is Release.SERVED
    assert Release.of("expired") is Release.EXPIRED
    assert Release.of("failed: peer gone") is Release.FAILED
    assert Release.of("something new") is Release.FAILED  # never mistaken for served
    assert Release.FAILED.because("publish on unit 1: x") == "failed: publish on unit 1: x"


def test_the_policy_and_verdict_strings_convert():
    kc = kvferry.checksum
    policy = kc.KVChecksumPolicy(fail_closed=True, load_failure_policy="recompute")
    assert Action(policy.on_load_error()) is Action.RECOMPUTE
    got = kc.KVChecksumPayload(40, [kc.KVChecksumGroup(0, [11, 22, 33], block_size=16, fingerprint=7)])
    v = kc.compare(None, got)
    assert Verdict(v.status) is Verdict.UNVERIFIED
    assert Action(policy.decide(v)) is Action.RECOMPUTE  # fail-closed: the load failure policy
