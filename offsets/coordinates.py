"""Origins, origin seqs and local offsets.

A record's identity at every site is its *coordinate* ``(origin, origin seq)``.
Its *local offset* is only where one site appended it. ``NewType`` keeps the
two integers apart in type checking.
"""

from __future__ import annotations

from typing import NamedTuple, NewType

from topology.ids import SiteId, site_id

OriginSeq = NewType("OriginSeq", int)
LocalOffset = NewType("LocalOffset", int)

EPOCH_MAX = 2**32 - 1


class InvalidOrigin(ValueError):
    """An origin string is not ``site@epoch``."""


class Origin(NamedTuple):
    """The site that first accepted a record, plus that site's epoch.

    A NamedTuple rather than a dataclass: origins are dict keys on the fetch and
    apply paths, and tuple hashing is the cheapest Python offers.
    """

    site: SiteId
    epoch: int

    def __str__(self) -> str:
        return f"{self.site}@{self.epoch}"

    @classmethod
    def parse(cls, text: str) -> Origin:
        site, sep, epoch = text.partition("@")
        if not sep or not (epoch.isascii() and epoch.isdigit()):
            raise InvalidOrigin(f"invalid origin {text!r}: expected 'site@epoch', for example 'a@1'")
        value = int(epoch)
        if value > EPOCH_MAX:
            raise InvalidOrigin(f"invalid origin {text!r}: epoch exceeds {EPOCH_MAX}")
        return cls(site_id(site), value)
