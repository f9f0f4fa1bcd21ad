"""API keys: `Authorization: Bearer <key>` against `api_key` + `api_key_file` (`RouterSettings.accepted_keys`)."""

from __future__ import annotations

import hmac

from fastapi import Request

from pdcluster.router.errors import APIError
from pdcluster.router.settings import RouterSettings


def has_key(settings: RouterSettings, request: Request) -> bool:
    """True when no API key is configured or the request's bearer token is one of them. Compared in constant
    time with every key (no early exit), so neither a key's bytes nor which key matched shows in the timing."""
    keys = settings.accepted_keys
    if not keys:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    presented = token.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    return matched and scheme.lower() == "bearer"


def check_auth(settings: RouterSettings, request: Request) -> None:
    if not has_key(settings, request):
        raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
