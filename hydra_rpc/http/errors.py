"""The OpenAI error body and the errors every HTTP route shares: whose fault, which status.

A client's mistake is a 4xx with OpenAI's ``{"error": {"message", "type", "param", "code"}}``;
an engine refusal maps to the status that tells the client what to do next (503 with
Retry-After while a model loads or reloads, 429 for a full slot queue).
"""
from __future__ import annotations

import json
import math
from typing import Any

from codec.json_text import lone_surrogate
from engine.jobs import BadInput, EngineBusy, EngineUnavailable, Unservable

from hydra_rpc.http.chat import dumps
from hydra_rpc.http.server.messages import Request, Response

ERROR_TYPES = {400: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
               429: "rate_limit_error", 501: "not_supported_error", 503: "unavailable_error"}


class ApiError(Exception):
    """Answered as an OpenAI-style error object (llama-server puts the HTTP status in ``code``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None, extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        return {**error_body(self.status, self.message, self.param), **self.extra}

    def response(self) -> Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body=dumps(obj), status=status, headers=headers, content_type="application/json")


def engine_error(e: BaseException) -> ApiError:
    """Map an engine refusal to an HTTP answer (never a traceback)."""
    if isinstance(e, EngineBusy):
        if e.retry_after_ms is not None:  # reloading with the reject policy: come back later
            return ApiError(503, str(e), headers={"Retry-After": str(max(1, math.ceil(e.retry_after_ms / 1000)))},
                            extra={"retry_after_ms": e.retry_after_ms})
        # the slot's queue (--slot-queue) is full: the request was deferred as far as llama-server
        # defers one, and the client may come back (503 + Retry-After, not 429: nobody is rate-limited)
        return ApiError(503, str(e), headers={"Retry-After": "1"}, extra={"retry_after_ms": 1000})
    if isinstance(e, BadInput):
        return ApiError(400, str(e))
    if isinstance(e, EngineUnavailable):
        return ApiError(503, str(e))
    if isinstance(e, Unservable):  # the server's configuration, not the request: llama-server's 500
        return ApiError(500, str(e))
    if type(e).__module__.startswith("jinja2"):  # the model's chat template refused the messages
        return ApiError(400, f"the chat template rejected the messages: {e}", param="messages")
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}")


def require_ready(engine: Any) -> None:
    if engine is None or engine.startup_stage != "ready":
        stage = getattr(engine, "startup_stage", "init")
        raise ApiError(503, f"no model loaded yet (startup stage {stage})", headers={"Retry-After": "1"})


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await request.read()  # read before the handler ran, under the body limit (http.limits.read_body)
    try:
        text = raw.decode("utf-8-sig")  # a BOM is skipped, as json.loads(bytes) and nlohmann do
        body = json.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"invalid JSON body: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid JSON body: nested too deeply") from None
    if (bad := lone_surrogate(text, body)) is not None:  # as llama-server's parser refuses it
        raise ApiError(400, f"invalid JSON body: an unpaired UTF-16 surrogate \\u{ord(bad):04x} in a string")
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(body).__name__}")
    return body


