"""Site ids: the short names of datacenters (ARCHITECTURE.md, vocabulary)."""

from __future__ import annotations

import re
from typing import NewType

SiteId = NewType("SiteId", str)

SITE_ID_MAX_CHARS = 32
_SITE_ID = re.compile(r"[a-z][a-z0-9-]{0,31}")


class InvalidSiteId(ValueError):
    """A site id does not match ``[a-z][a-z0-9-]{0,31}``."""


def site_id(text: str) -> SiteId:
    """Validate ``text`` and return it as a :data:`SiteId`."""
    if not _SITE_ID.fullmatch(text):
        raise InvalidSiteId(
            f"invalid site id {text!r}: use 1-32 characters, a lowercase letter "
            "first, then lowercase letters, digits or '-' (for example 'us-east')"
        )
    return SiteId(text)
