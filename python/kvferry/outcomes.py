"""Names of the outcomes kvferry reports, as enums that are also the strings it has always
returned: a checksum verdict's ``status``, the failure policy's action, and why a producer
released a lease. Each member is a ``str`` equal to its value (``Verdict.VERIFIED ==
"verified"``, ``str(Action.RECOMPUTE) == "recompute"``), so code that compares the strings
keeps working, and ``Verdict(verdict.status)`` turns a returned string into the member
(``ValueError`` for anything else).
"""

from __future__ import annotations

import enum

__all__ = ["Action", "Release", "Verdict"]


class _StrEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` and format are its value on every Python (as 3.11's
    ``StrEnum``)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Verdict(_StrEnum):
    """``KVChecksumVerdict.status``: every compared position matches, some differ, or the load
    could not be checked (no payload, no positions, a bad carrier; or it never landed)."""

    VERIFIED = "verified"
    MISMATCH = "mismatch"
    UNVERIFIED = "unverified"


class Action(_StrEnum):
    """What the failure policy says to do with a load (``KVChecksumPolicy.decide``,
    ``on_load_error``; ``LoadResult.action``): keep it, fail the request, or recompute the
    prompt."""

    COMPLETE = "complete"
    FAIL = "fail"
    RECOMPUTE = "recompute"


class Release(_StrEnum):
    """Why a producer released a lease (``Producer.released()``): its consumer was served, no
    consumer came before the lease ran out, or serving failed. A failure's reason is
    ``"failed: <why>"``: it starts with :attr:`FAILED` and is not equal to it; use
    :meth:`of` to classify any reason."""

    SERVED = "served"
    EXPIRED = "expired"
    FAILED = "failed"

    @classmethod
    def of(cls, reason: str) -> Release:
        """The member a released reason is: ``"served"``, ``"expired"``, or ``"failed: ..."``
        (anything else is taken as a failure too, so it is never mistaken for served)."""
        if reason == cls.SERVED:
            return cls.SERVED
        if reason == cls.EXPIRED:
            return cls.EXPIRED
        return cls.FAILED

    def because(self, why: str) -> str:
        """The released reason of this kind with ``why`` (``"failed: <why>"``); only
        :attr:`FAILED` takes one."""
        if self is not Release.FAILED:
            raise ValueError(f"a {self.value} release carries no reason")
        return f"{self.value}: {why}"
