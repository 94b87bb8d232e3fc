"""The engine's HTTP side (docs/http.md), served by ``http.server`` on the RPC server's event loop.

Routes (the contract is written down in ``docs/http.md``)::

    GET  /health                       200 ready, 503 while the first model loads (or failed)
    GET  /version
    GET  /v1/models, /models; POST /models/load, /models/unload   see http.models
    GET  /slots                        one entry per slot, from the actor's snapshots
    GET  /slots/{id}/state/meta        the STATE_META fields
    GET, PUT /slots/{id}/state         KV state transfer, see http.state
    POST /slots/{id}?action=erase      a working slot: done when its job ends
    POST /slots/{id}?action=save|restore  slot files (--slot-save-path), see http.slot_actions
    GET  /v1/decode/{decode_request_id}  merged DECODE v3 result: 202 running, 200 done, 404 gone
    DELETE /v1/decode/{decode_request_id}  (extension) cancel a running merged DECODE
    POST /v1/chat/completions, /v1/completions (+ unversioned twins)   see http.openai
    POST /completion, /tokenize, /detokenize, /apply-template; GET /props   llama-server's, see http.llama
    GET  /metrics                      Prometheus text format

Reads (health, slots, meta, decode progress, metrics) come from published snapshots and
plain attributes, never from the actor's mailbox, so they answer while every slot is busy.
Every failure is a JSON error object with a real status; a bug in a handler becomes a
500 with the exception's type and message, never a traceback.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from engine.jobs import EngineBusy

from hydra_rpc.hydra.engine_meta import ENGINE_NAME, ENGINE_VERSION, slot_entry, slot_meta
from hydra_rpc.http.limits import max_body_for, read_body
from hydra_rpc.http.chat import FINISH_REASON
from hydra_rpc.http.errors import ApiError, error_body, json_response, require_ready
from hydra_rpc.http.openai import OpenAIRoutes, completion_object, cut_at_stop, timings_of
from hydra_rpc.http.models import ModelRoutes
from hydra_rpc.http.server.messages import Request, Response, StreamResponse
from hydra_rpc.http.server.router import NoRoute, Router
from hydra_rpc.http.server.serve import HttpServer
from hydra_rpc.http.slot_actions import ACTIONS as FILE_ACTIONS
from hydra_rpc.http.slot_actions import slot_file_action
from hydra_rpc.http.state import StateRoutes
from hydra_rpc.http.state import path_number as _number
from hydra_rpc.http.state import slot_of as _slot_of
from hydra_rpc.http.llama import LlamaRoutes
from hydra_rpc.observability.metrics import CONTENT_TYPE, Metrics
from hydra_rpc.services import Services

log = logging.getLogger("hydra_rpc.http")

try:
    from importlib.metadata import version as _pkg_version

    IMPL_VERSION = _pkg_version("hydra-rpc")
except Exception:  # running from a checkout that is not installed
    IMPL_VERSION = "0.0.0+local"

KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class HttpSide:
    """What ``App`` keeps: the bound address and an idempotent ``cleanup()``."""

    def __init__(self, server: HttpServer):
        self.server = server
        self._closed = False

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    @property
    def connections(self) -> int:
        return len(self.server.connections)

    async def cleanup(self) -> None:
        if not self._closed:
            self._closed = True
            await self.server.close()


async def start_http(services: Services, host: str, port: int) -> HttpSide:
    """Bind the HTTP side (port 0 picks a free port) on the running loop."""
    max_body = services.settings.http_max_body or max_body_for(services.engine.params)
    metrics, cfg = services.metrics, services.settings
    server = HttpServer(build_http_app(services, metrics, max_body), cfg, services.budget)
    server.listen(host, port)
    side = HttpSide(server)
    metrics.bind(services, lambda: side.connections)
    return side


class HttpApp:
    """Routes a request and answers it: the allow list, the body read under its limit, the
    handler, every failure as a JSON error with its status, and the request's metrics."""

    def __init__(self, metrics: Metrics, max_body: int):
        self.metrics, self.max_body = metrics, max_body
        self.router = Router()

    async def __call__(self, request: Request) -> Response | StreamResponse:
        t0 = time.perf_counter()
        code, route = 500, None
        try:
            if not request.conn.peer_allowed:  # the same --allow list as the engine port
                raise ApiError(403, f"client {request.remote} is not in the allow list")
            route, request.match_info = self.router.resolve(request.method, request.path)
            if not getattr(route.handler, "streams_body", False):
                await read_body(request, self.max_body)
            resp = await route.handler(request)
            code = resp.status
            return resp
        except ApiError as e:
            code = e.status
            return e.response()
        except NoRoute as e:
            code = e.status
            return _no_route(request, e)
        except (asyncio.CancelledError, ConnectionResetError):
            code = 499  # client closed the request (nginx's convention)
            raise
        except Exception as e:
            log.exception("HTTP %s %s failed", request.method, request.path)
            return json_response(error_body(500, f"internal error: {type(e).__name__}: {e}"), status=500)
        finally:
            method = request.method if request.method in KNOWN_METHODS else "other"  # bounded labels
            self.metrics.observe_http(route.canonical if route is not None else "unmatched", method, code,
                                      time.perf_counter() - t0)


def _no_route(request: Request, e: NoRoute) -> Response:
    if e.status == 404:
        return json_response(error_body(404, f"no such endpoint: {request.method} {request.path}"), status=404)
    allowed = ", ".join(sorted(e.allowed))
    return json_response(error_body(405, f"method {request.method} not allowed on {request.path} "
                                         f"(allowed: {allowed})"), status=405, headers={"Allow": allowed})


def build_http_app(services: Services, metrics: Metrics, max_body: int) -> HttpApp:
    app = HttpApp(metrics, max_body)
    routes = Routes(services, metrics)
    r = app.router
    r.add_get("/health", routes.health)
    r.add_get("/version", routes.version)
    r.add_get("/slots", routes.slots)
    r.add_get("/slots/{slot_id}/state/meta", routes.slot_meta)
    r.add_post("/slots/{slot_id}", routes.slot_action)
    r.add_get("/v1/decode/{decode_request_id}", routes.decode_result)
    r.add_delete("/v1/decode/{decode_request_id}", routes.decode_cancel)
    r.add_get("/metrics", routes.prometheus)
    OpenAIRoutes(services, metrics).add_to(r)
    LlamaRoutes(services, metrics).add_to(r)
    ModelRoutes(services).add_to(r)
    StateRoutes(services).add_to(r)
    return app


class Routes:
    def __init__(self, services: Services, metrics: Metrics):
        self.services = services
        self.metrics = metrics

    @property
    def engine(self) -> Any:
        return self.services.engine

    # ---------------------------------------------------------------- status
    async def health(self, request: Request) -> Response:
        eng = self.engine
        server = self.services.hydra
        stage = eng.startup_stage if eng is not None else "init"
        ready = eng is not None and eng.ready
        body: dict[str, Any] = {
            "status": "ok" if ready else ("error" if stage == "failed" else "loading"),
            "startup_stage": stage,
            "has_model": ready,
            "model_name": eng.identity.model_name if eng is not None else "",
            "rpc_active": server is not None and bool(server.sockets),
        }
        if eng is not None:
            body["config_generation"] = eng.generation
            body["reload"] = eng.reload.state.value
            if stage == "failed":
                body["error"] = eng.startup_error
        return json_response(body, status=200 if ready else 503,
                             headers=None if ready or stage == "failed" else {"Retry-After": "1"})

    async def version(self, request: Request) -> Response:
        eng = self.engine
        return json_response({"version": ENGINE_VERSION, "engine": ENGINE_NAME, "implementation": "hydra-rpc",
                              "implementation_version": IMPL_VERSION,
                              "config_generation": eng.generation if eng is not None else 0})

    def _endpoint_enabled(self, name: str) -> None:
        """llama-server's ``--metrics`` / ``--no-slots``: a disabled endpoint answers 501."""
        if not getattr(self.services.settings, f"http_{name}"):
            raise ApiError(501, f"This server does not support {name} endpoint. Start it with `--{name}`")

    async def prometheus(self, request: Request) -> Response:
        self._endpoint_enabled("metrics")
        return Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ---------------------------------------------------------------- slots
    async def slots(self, request: Request) -> Response:
        """503 until the model is loaded and the slots are wired (a node agent's health probe)."""
        self._endpoint_enabled("slots")
        eng = self.engine
        if eng is None or not eng.ready:
            raise ApiError(503, "Loading model", headers={"Retry-After": "1"})
        return json_response([{**slot_entry(s, eng.n_ctx_slot), "checkpoints": eng.checkpoints_of(s.slot_id)}
                              for s in eng.snapshots])

    async def slot_meta(self, request: Request) -> Response:
        slot = _slot_of(request, self.engine)
        return json_response(slot_meta(self.engine.snapshot(slot), slot, self.engine.kv_cache))

    async def slot_action(self, request: Request) -> Response:
        eng = self.engine
        slot = _slot_of(request, eng)
        action = request.query.get("action", "")
        if action != "erase" and action not in FILE_ACTIONS:
            raise ApiError(400, f"unsupported slot action {action[:40]!r} (erase, save or restore)", param="action")
        require_ready(eng)
        if action in FILE_ACTIONS:
            return await slot_file_action(request, eng, slot, action, self._busy)
        try:  # a busy slot is erased when its job ends, as llama-server defers it (engine/erase.py)
            n_erased = await eng.erase(slot)
        except EngineBusy as e:  # still busy past the bound: nothing was erased
            snap = eng.snapshot(slot)
            raise ApiError(503, str(e), headers={"Retry-After": "1"},
                           extra={"reason": str(e), "slot_id": slot, "operation": snap.operation,
                                  "queued": snap.queued}) from None
        return json_response({"id_slot": slot, "n_erased": n_erased})

    @staticmethod
    def _busy(slot: int, snap: Any) -> ApiError:
        what = "transferring state" if snap.is_transferring else f"processing ({snap.operation})"
        reason = f"slot {slot} is {what}" + (f" with {snap.queued} job(s) queued" if snap.queued else "")
        return ApiError(409, reason, extra={"reason": reason, "slot_id": slot, "operation": snap.operation,
                                            "queued": snap.queued})

    # ---------------------------------------------------------------- merged DECODE results
    def _decode_entry(self, request: Request) -> Any:
        raw = request.match_info["decode_request_id"]
        decode_id = _number(raw)
        results = self.services.decode_results
        entry = results.get(decode_id) if results is not None and decode_id is not None else None
        if entry is None:
            ttl = getattr(results, "ttl", 0)
            raise ApiError(404, f"no merged DECODE result {raw[:40]!r} (unknown, or evicted after {ttl:g} s / "
                                f"beyond the newest {getattr(results, 'max_entries', 0)})",
                           extra={"decode_request_id": -1 if decode_id is None else decode_id})
        return entry

    async def decode_cancel(self, request: Request) -> Response:
        """Extension: stop a running merged DECODE (its slot frees before the next step);
        the entry then answers GET with the partial result and ``stop_reason`` cancelled."""
        entry = self._decode_entry(request)
        running = entry.state == "running"
        if running:
            entry.job.cancel()
        return json_response({"decode_request_id": entry.id, "status": "cancelling" if running else entry.state,
                              "cancelled": running}, status=202 if running else 200)

    async def decode_result(self, request: Request) -> Response:
        entry = self._decode_entry(request)
        base = {"decode_request_id": entry.id, "slot": entry.slot, "n_past_after_restore": entry.n_past_after_restore}
        age_ms = round((time.monotonic() - entry.created) * 1000, 3)
        if entry.state == "running":
            return json_response({**base, "status": "running", **self._progress(entry), "elapsed_ms": age_ms},
                                 status=202)
        res = entry.result
        if entry.state == "failed" or res is None:
            # failed: the engine raised (500); cancelled with nothing generated: the engine
            # was stopping (503). A cancelled job that did produce a result is answered below.
            status = 500 if entry.state == "failed" else 503
            msg = entry.error or entry.state
            return json_response({**error_body(status, f"merged DECODE {entry.id} {entry.state}: {msg}"), **base,
                                  "status": entry.state}, status=status)
        eng = self.engine
        model = entry.model or (eng.identity.model_alias or eng.identity.model_name)
        text, hit = cut_at_stop(res.text.decode("utf-8", "replace"), entry.job.request.stop)
        finish = "stop" if hit else FINISH_REASON.get(res.stop_reason)
        created = int(time.time() - (time.monotonic() - entry.created))
        obj = completion_object("chat", f"chatcmpl-decode-{entry.id}", created, model, text, finish, res,
                                res.config_generation)
        obj.update(base)
        obj.update(status=entry.state, n_past=res.n_past, tokens_generated=res.tokens_generated,
                   stop_reason=res.stop_reason, config_generation=res.config_generation, timings=timings_of(res))
        return json_response(obj)

    def _progress(self, entry: Any) -> dict[str, Any]:
        # Tokens delivered so far sit in the job's event queue: nobody consumes them for a
        # merged DECODE. The slot snapshot adds the phase when this job is the one running.
        out: dict[str, Any] = {"tokens_generated": entry.job.events_waiting, "operation": "queued"}
        eng = self.engine
        snap = eng.snapshot(entry.slot) if eng is not None and 0 <= entry.slot < eng.n_slots else None
        if snap is not None and snap.job_id == entry.job.id:
            out.update(operation=snap.operation, n_past=snap.n_past, tokens_processed=snap.tokens_processed,
                       tokens_total=snap.tokens_total, progress=round(snap.progress, 6))
        elif snap is not None and entry.job.id in snap.queued_jobs:
            out.update(waiting_on=snap.waiting_on if snap.waiting_on in ("transfer", "reload") else "queue",
                       queue_position=snap.queued_jobs.index(entry.job.id) + 1)
        return out
