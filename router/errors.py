"""OpenAI-shaped errors: every non-2xx answer is {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable_error", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None, extra: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.extra = extra   # more top-level fields of the body, beside "error" (/health's topology)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str, served: list[str]) -> APIError:
    return APIError(404, f"The model '{name}' does not exist; this router serves {', '.join(map(repr, served))}",
                     param="model", code="model_not_found")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "api_error" if status >= 500
                                                             else "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    headers = {}
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    return JSONResponse({**(err.extra or {}), **error_body(err.status, err.message, err.param, err.code)},
                        status_code=err.status, headers=headers)


def from_validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}",
                           code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Drop pydantic's union-branch names ("str", "list[int]") from the location.
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool",
                                                                        "function-after", "list")]
    param = ".".join(loc) or None
    if first.get("type") == "missing" and param:
        message = f"'{param}' is a required property"
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    return bad_request(message, param=param, code="invalid_value" if param else None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail)))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))
