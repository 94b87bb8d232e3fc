"""Routes: a method and a path (whose ``{name}`` segments match any one segment) to a handler.

A path no route has is a 404; a path whose routes take other methods is a 405 with ``Allow``.
A GET route answers HEAD too (the body left out).
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

Handler = Callable[[Any], Awaitable[Any]]


class Route:
    __slots__ = ("method", "canonical", "handler")

    def __init__(self, method: str, canonical: str, handler: Handler):
        self.method, self.canonical, self.handler = method, canonical, handler


class NoRoute(Exception):
    """``status`` 404 (no such path) or 405 (``allowed``: the methods the path takes)."""

    def __init__(self, status: int, allowed: tuple[str, ...] = ()):
        super().__init__(status)
        self.status, self.allowed = status, allowed


def _segments(path: str) -> tuple[str, ...]:
    return tuple(path.split("/"))


def _is_variable(segment: str) -> bool:
    return segment.startswith("{") and segment.endswith("}")


class Router:
    def __init__(self) -> None:
        self._fixed: dict[str, dict[str, Route]] = {}  # path → method → route
        self._patterns: list[tuple[tuple[str, ...], dict[str, Route]]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        segments = _segments(path)
        if any(_is_variable(s) for s in segments):
            for known, routes in self._patterns:
                if known == segments:
                    break
            else:
                routes = {}
                self._patterns.append((segments, routes))
        else:
            routes = self._fixed.setdefault(path, {})
        if method in routes:
            raise ValueError(f"{method} {path} is routed twice")
        routes[method] = Route(method, path, handler)
        if method == "GET":
            routes.setdefault("HEAD", Route("HEAD", path, handler))

    def add_get(self, path: str, handler: Handler) -> None:
        self.add("GET", path, handler)

    def add_post(self, path: str, handler: Handler) -> None:
        self.add("POST", path, handler)

    def add_put(self, path: str, handler: Handler) -> None:
        self.add("PUT", path, handler)

    def add_delete(self, path: str, handler: Handler) -> None:
        self.add("DELETE", path, handler)

    def resolve(self, method: str, path: str) -> tuple[Route, dict[str, str]]:
        """The route and the path's ``{name}`` values; :class:`NoRoute` when there is none."""
        routes = self._fixed.get(path)
        values: dict[str, str] = {}
        if routes is None:
            routes, values = self._match(path)
        if routes is None:
            raise NoRoute(404)
        route = routes.get(method)
        if route is None:
            raise NoRoute(405, tuple(routes))
        return route, values

    def _match(self, path: str) -> tuple[dict[str, Route] | None, dict[str, str]]:
        segments = _segments(path)
        for pattern, routes in self._patterns:
            if len(pattern) != len(segments):
                continue
            values = {}
            for want, got in zip(pattern, segments):
                if _is_variable(want):
                    if not got:
                        break
                    values[want[1:-1]] = got
                elif want != got:
                    break
            else:
                return routes, values
        return None, {}
