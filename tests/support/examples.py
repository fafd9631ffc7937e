"""How many examples a property test draws: all of them in ``make test``, a share in ``make test-quick``.

``make test-quick`` sets ``GEOREP_EXAMPLES_SCALE=0.25``: the same properties, a quarter of the draws, so the quick
loop stays under its budget while ``make test`` (and CI) keeps every example. Never below ``MIN_EXAMPLES``: a
property drawn a handful of times proves little.
"""

from __future__ import annotations

import os

MIN_EXAMPLES = 10


def _scale() -> float:
    raw = os.environ.get("GEOREP_EXAMPLES_SCALE", "1")
    try:
        scale = float(raw)
    except ValueError:
        raise SystemExit(f"GEOREP_EXAMPLES_SCALE={raw!r}: give a number in (0, 1], e.g. 0.25") from None
    if not 0 < scale <= 1:
        raise SystemExit(f"GEOREP_EXAMPLES_SCALE={raw!r}: give a number in (0, 1], e.g. 0.25")
    return scale


SCALE = _scale()


def examples(full: int) -> int:
    """``full`` examples scaled by ``GEOREP_EXAMPLES_SCALE``, at least ``MIN_EXAMPLES`` (or ``full`` if smaller)."""
    return max(min(full, MIN_EXAMPLES), round(full * SCALE))
