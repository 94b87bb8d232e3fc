"""``POST /slots/{id}?action=save|restore`` with ``{"filename": …}``: llama-server's slot files.

Needs ``--slot-save-path DIR`` (else 501, as llama-server answers); the file is a plain name
inside DIR (``engine.slot_files`` checks it: a path, "..", a control character → 400). The
replies are llama-server's::

    save     {"id_slot", "filename", "n_saved": tokens, "n_written": bytes, "timings": {"save_ms"}}
    restore  {"id_slot", "filename", "n_restored": tokens, "n_read": bytes, "timings": {"restore_ms"}}

A slot that is working answers 409, like ``action=erase`` (llama-server defers the task).
"""
from __future__ import annotations

from typing import Any, Callable

from engine import slot_files
from engine.jobs import BadInput, EngineBusy

from hydra_rpc.http.errors import ApiError, json_response, read_json_object
from hydra_rpc.http.server.messages import Request, Response

ACTIONS = ("save", "restore")


async def slot_file_action(request: Request, engine: Any, slot: int, action: str,
                           busy: Callable[[int, Any], ApiError]) -> Response:
    if not engine.slot_save_path:
        raise ApiError(501, "this server does not support slot files: start it with --slot-save-path DIR")
    body = await read_json_object(request)
    filename = body.get("filename")
    if not isinstance(filename, str):
        raise ApiError(400, "'filename' must be a string (a file name inside the slot directory)", param="filename")
    run = slot_files.save if action == "save" else slot_files.restore
    try:
        res = await run(engine, slot, filename)
    except BadInput as e:
        raise ApiError(400, str(e), param="filename") from None
    except EngineBusy:
        raise busy(slot, engine.snapshot(slot)) from None
    except OSError as e:  # the directory is not writable, the disk is full: the operator's to fix
        raise ApiError(500, f"unable to {action} slot {slot} as {filename!r}: {e.strerror or e}") from None
    ms = round(res.ms, 3)
    if action == "save":
        return json_response({"id_slot": slot, "filename": res.filename, "n_saved": res.n_tokens,
                              "n_written": res.n_bytes, "timings": {"save_ms": ms}})
    return json_response({"id_slot": slot, "filename": res.filename, "n_restored": res.n_tokens,
                          "n_read": res.n_bytes, "timings": {"restore_ms": ms}})
