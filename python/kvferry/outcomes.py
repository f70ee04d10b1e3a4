"""Names of the outcomes kvferry reports, as enums that are also the strings it has always
returned: a checksum verdict's ``status``, the failure policy's action, and the kind of why a
producer released a lease (:class:`ReleaseReason`, that kind with a failure's text). Each member is a ``str`` equal to its value (``Verdict.VERIFIED ==
"verified"``, ``str(Action.RECOMPUTE) == "recompute"``), so code that compares the strings
keeps working, and ``Verdict(verdict.status)`` turns a returned string into the member
(``ValueError`` for anything else).
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Action", "Release", "ReleaseReason", "Verdict"]


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
    """Why a producer released a lease: its consumer was served, no consumer loaded it before
    the lease ran out (a request refused before any write leaves the lease held), or serving
    failed once its writes had started. ``Producer.released()`` gives it as the ``kind`` of a
    :class:`ReleaseReason`."""

    SERVED = "served"
    EXPIRED = "expired"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class ReleaseReason:
    """Why a producer released a lease (``Producer.released()``'s second item): ``kind``, a
    :class:`Release`, and for :attr:`Release.FAILED` only, ``why``, the failure's text (for
    logs: classify by ``kind``, never by the text). ``str()`` is the reason as a log line says
    it: ``"served"``, ``"expired"`` or ``"failed: <why>"``."""

    kind: Release
    why: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Release(self.kind))
        if (self.why is None) != (self.kind is not Release.FAILED):
            raise ValueError(f"a {self.kind.value} release {'needs' if self.why is None else 'carries no'} reason")

    @classmethod
    def failed(cls, why: str) -> ReleaseReason:
        """A failed release because of ``why``."""
        return cls(Release.FAILED, why)

    def __str__(self) -> str:
        return self.kind.value if self.why is None else f"{self.kind.value}: {self.why}"
