"""Secrets out of every URL kvtier prints: logs, errors, reports. Torch-free.

A URL's password (``redis://:secret@host``, ``redis://user:secret@host``) and
secret-bearing query parameters (``?password=``, ``?token=``) are replaced by
``***``; the rest of the URL stays, so a message still says which pool it means.
"""

from __future__ import annotations

import re

_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^/@\s:]*):[^@\s/]*@")
_QUERY = re.compile(r"([?&](?:password|passwd|pass|token|secret|access_key|key)=)[^&\s'\"]*", re.IGNORECASE)


def redact(text: object) -> str:
    """``text`` with the passwords of the URLs in it replaced by ``***``."""
    return _QUERY.sub(r"\1***", _USERINFO.sub(r"\1:***@", str(text)))
