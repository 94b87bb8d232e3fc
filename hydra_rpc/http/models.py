"""Models over HTTP, shaped like llama-server's router mode (docs/http.md, "Models").

    GET  /v1/models, /models   the resident model, then every ``--model-alias``, each with
                               ``status.value`` loaded | loading | unloaded
    POST /models/load          {"model": alias}: a reload to that alias (shadow: the old model
                               serves until the swap); 200 {"success": true} at once
    POST /models/unload        {"model": alias}: cancels a pending load of it

llama-server's router runs one child process per model; this engine serves exactly one model
and swaps it with a reload, so "load" maps onto a reload and "unload" can only take back a
load that has not happened yet. Every 2xx body holds a boolean ``success``, which Hydra Core
requires.
"""
from __future__ import annotations

from typing import Any

from engine.jobs import EngineUnavailable
from engine.status import flat_fields

from hydra_rpc.http.errors import ApiError, engine_error, json_response, read_json_object, require_ready
from hydra_rpc.services import Services
from hydra_rpc.http.server.messages import Request, Response
from hydra_rpc.http.server.router import Router

# our alias states → llama-server's status.value
_STATUS = {"loaded": "loaded", "loading": "loading", "unloaded": "unloaded", "failed": "unloaded"}


class ModelRoutes:
    def __init__(self, services: Services):
        self.services = services

    def add_to(self, router: Router) -> None:
        router.add_get("/v1/models", self.models)
        router.add_get("/models", self.models)
        router.add_post("/models/load", self.load)
        router.add_post("/models/unload", self.unload)

    async def models(self, request: Request) -> Response:
        eng = self.services.engine
        require_ready(eng)
        resident = eng.identity.display_name
        meta = {k: v for k, v in flat_fields(eng.identity).items() if k != "model_path"}
        data = [{**_entry(resident, "loaded"), "resident": True,
                 "meta": {**meta, "n_ctx_slot": eng.n_ctx_slot, "n_slots": eng.n_slots,
                          "config_generation": eng.generation}}]
        for alias, state in eng.model_states().items():
            if alias != resident:
                data.append({**_entry(alias, state), "resident": state == "loaded"})
        return json_response({"object": "list", "data": data})

    async def load(self, request: Request) -> Response:
        eng = self.services.engine
        require_ready(eng)
        name = await self._model_name(request)
        state = self._state(name, 404)
        if state in ("loaded", "loading"):  # as llama-server's fork: loading what runs is a success
            return json_response({"success": True, "model": name, "status": state,
                                  "config_generation": eng.generation})
        try:
            out = await eng.swap_model(name)
        except EngineUnavailable as e:
            raise engine_error(e) from None
        if out.rejected_keys:  # e.g. the alias's file cannot be loaded with this context
            raise ApiError(400, f"model {name!r}: " + "; ".join(f"{k}: {v}" for k, v in out.rejected_keys.items()),
                           param="model")
        return json_response({"success": True, "model": name, "status": "loading",
                              "config_generation": out.config_generation})

    async def unload(self, request: Request) -> Response:
        eng = self.services.engine
        require_ready(eng)
        name = await self._model_name(request)
        state = self._state(name, 400)
        if state == "loaded":
            raise ApiError(409, f"model {name!r} is the resident model: this engine always serves one model; "
                                f"POST /models/load another one to replace it", param="model")
        if state == "loading":  # asking for the live model again drops the pending reload
            await eng.configure({"model_path": eng.params.model_path})
        return json_response({"success": True, "model": name, "status": "unloaded"})

    async def _model_name(self, request: Request) -> str:
        name = (await read_json_object(request)).get("model")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'model' must be a non-empty string (a model alias)", param="model")
        return name

    def _state(self, name: str, unknown_status: int) -> str:
        """The alias's state; the resident model's own name counts as loaded. Unknown names:
        ``unknown_status`` (llama-server: 404 on load, 400 on unload)."""
        eng = self.services.engine
        states = eng.model_states()
        if name in states:
            return states[name]
        if name in (eng.identity.display_name, eng.identity.model_name):
            return "loaded"
        raise ApiError(unknown_status, "model is not found", param="model",
                       extra={"models": [eng.identity.display_name, *states]})


def _entry(model_id: str, state: str) -> dict[str, Any]:
    status: dict[str, Any] = {"value": _STATUS[state], "args": []}
    if state == "failed":
        status["failed"] = True
    return {"id": model_id, "aliases": [], "tags": [], "object": "model", "owned_by": "hydra-rpc", "created": 0,
            "status": status}
