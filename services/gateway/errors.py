"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from aiohttp import web

# HTTP status -> OpenAI error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """Raised by handlers; the middleware turns it into an OpenAI error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)
