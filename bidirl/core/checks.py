"""Field checks shared by the protocol's records and the event log's spans: each names the record and field."""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np


def finite(value: Any, record: str, name: str) -> float:
    """``value`` as a finite float, else ValueError naming ``record.name``."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{record}.{name} must be a number of seconds, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{record}.{name} must be finite, got {x!r}")
    return x


def integer(value: Any, record: str, name: str, minimum: Optional[int] = None) -> int:
    """``value`` as an int (a whole float is accepted), else ValueError naming ``record.name``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            value = int(value)
        else:
            raise ValueError(f"{record}.{name} must be an integer, got {value!r}")
    x = int(value)
    if minimum is not None and x < minimum:
        raise ValueError(f"{record}.{name} must be >= {minimum}, got {x}")
    return x


def choice(value: Any, allowed: tuple, record: str, name: str) -> str:
    """``value`` if it is one of ``allowed``, else ValueError listing them."""
    if value not in allowed:
        raise ValueError(f"{record}.{name} must be one of {', '.join(allowed)}; got {value!r}")
    return str(value)
