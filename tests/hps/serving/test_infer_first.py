"""The v2 application sends ``POST .../infer`` straight to its handler
(:class:`~hps.serving.http_server.inference.InferFirst`): the paths it takes, and their
parameters, are exactly those Starlette's inference routes match; every other request still
reaches the router."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Match, Route

from hps.serving.http_server.inference import InferFirst, Receive, Scope, Send, infer_path_params

PATHS = [
    "/v2/models/dlrm/infer",
    "/v2/models/dlrm/versions/1/infer",
    "/v2/models/a%20b/infer",
    "/v2/models/a b/infer",
    "/v2/models/dlrm/versions//infer",
    "/v2/models//infer",
    "/v2/models/infer",
    "/v2/models/dlrm/infer/",
    "/v2/models/dlrm/ready",
    "/v2/models/dlrm/versions/1/2/infer",
    "/v2/models/dlrm/version/1/infer",
    "/v2/models/a/b/infer",
    "/v2/models/dlrm/inferx",
    "/v1/models/dlrm/infer",
    "/v2/models/stats",
    "/v2/models/d.l-r_m/versions/v2.0/infer",
]


async def _noop(request: Request) -> Response:
    return Response()


def _starlette_params(path: str) -> dict[str, str] | None:
    """What Starlette's two inference routes match on ``path`` (``POST``)."""
    for template in ("/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer"):
        route = Route(template, _noop, methods=["POST"])
        scope = {"type": "http", "method": "POST", "path": path, "root_path": ""}
        match, child = route.matches(scope)
        if match is Match.FULL:
            return dict(child["path_params"])
    return None


@pytest.mark.parametrize("path", PATHS)
def test_the_paths_taken_are_those_starlettes_routes_match(path: str) -> None:
    assert infer_path_params(path) == _starlette_params(path)


def _call(app: InferFirst, method: str, path: str) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 5),
        "server": ("127.0.0.1", 80),
        "scheme": "http",
        "http_version": "1.1",
        "asgi": {"version": "3.0"},
    }
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_posts_to_inference_paths_reach_the_handler_and_the_rest_the_router() -> None:
    seen: list[dict[str, str]] = []

    async def infer(scope: Scope, receive: Receive, send: Send, params: dict[str, str]) -> None:
        seen.append(params)
        await PlainTextResponse("inferred")(scope, receive, send)

    async def other(request: Request) -> Response:
        return PlainTextResponse(f"router {request.method}")

    router = Starlette(routes=[Route("/v2/models/{model}/{rest:path}", other, methods=["GET"])])
    app = InferFirst(router, infer)
    assert _call(app, "POST", "/v2/models/m/versions/7/infer") == (200, b"inferred")
    assert seen == [{"model": "m", "version": "7"}]
    assert _call(app, "GET", "/v2/models/m/infer") == (200, b"router GET")
    assert _call(app, "POST", "/v2/models/m/ready")[0] == 405  # the router's answer
    assert seen == [{"model": "m", "version": "7"}]
