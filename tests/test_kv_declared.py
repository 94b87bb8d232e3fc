"""What a sequence state's bytes mean beyond llama.cpp's header — K/V rotated before storing, the
RoPE applied to K — is declared by the sender (DECODE v3 ``kv_metadata.kv_cache``, HTTP
``X-Hydra-KV-Cache``) and a declaration that differs from this engine's KV cache is refused with
``kv_state_mismatch`` naming the field; the slot keeps what it held. A binary STATE_PUT has no
place for it (docs/protocol.md §6.4)."""
from __future__ import annotations

import copy
import json

import pytest

from codec import decode_v3 as V3
from codec.enums import Op, Status
from engine.kv_cache import DECLARED_FIELDS, BadDeclaration, KvCacheInfo, KvStateMismatch, check_declared

SERVER_ARGS = ("--model", "tiny", "--parallel", "3", "--threads", "1", "--log-level", "WARNING")
pytestmark = pytest.mark.timeout(120)
GEN = {"n_predict": 2, "sampling": {"temp": 0}, "stop": [], "stream": False, "chat_syntax": "", "oaicompat_model": ""}
ROPE = {"scaling": "unspecified", "freq_base": 0.0, "freq_scale": 0.0, "yarn_ext_factor": -1.0,
        "yarn_attn_factor": -1.0, "yarn_beta_fast": -1.0, "yarn_beta_slow": -1.0, "yarn_orig_ctx": 0}


def info(rotation=(True, True), **rope) -> KvCacheInfo:
    return KvCacheInfo("q8_0", "q8_0", "on", True, 4096, 4096, rope={**ROPE, **rope}, rotation=rotation)


# ---- the comparison ------------------------------------------------------------------------------

def test_a_declaration_equal_to_ours_or_absent_passes():
    ours = info()
    check_declared(ours, None)  # a sender that declares nothing (a binary STATE_PUT) is not checked
    check_declared(ours, {})
    check_declared(ours, ours.as_dict)  # INFO's / STATE_META's kv_cache as published
    check_declared(ours, {"attn_rotation": {"k": True}})  # only what is declared is compared
    check_declared(ours, {"rope": {"freq_base": 0}})  # 0 and 0.0 are the same number


@pytest.mark.parametrize("declared, field, got, want", [
    ({"attn_rotation": {"k": False, "v": True}}, "kv_cache.attn_rotation.k", False, True),
    ({"attn_rotation": {"k": True, "v": False}}, "kv_cache.attn_rotation.v", False, True),
    ({"rope": {"freq_base": 500000.0}}, "kv_cache.rope.freq_base", 500000.0, 0.0),
    ({"rope": {"scaling": "yarn"}}, "kv_cache.rope.scaling", "yarn", "unspecified"),
    ({"rope": {"yarn_orig_ctx": 8192}}, "kv_cache.rope.yarn_orig_ctx", 8192, 0),
])
def test_a_declaration_that_differs_is_refused_naming_the_field(declared, field, got, want):
    with pytest.raises(KvStateMismatch) as e:
        check_declared(info(), declared)
    assert e.value.as_meta() == {"error": "kv_state_mismatch", "field": field, "got": got, "want": want}


def test_a_rotated_sender_and_an_unrotated_receiver_disagree_both_ways():
    with pytest.raises(KvStateMismatch, match="attn_rotation.k"):
        check_declared(info(rotation=(False, False)), info().as_dict)
    with pytest.raises(KvStateMismatch, match="attn_rotation.k"):
        check_declared(info(), info(rotation=(False, False)).as_dict)
    with pytest.raises(KvStateMismatch):  # a truthy number is not a rotation flag
        check_declared(info(), {"attn_rotation": {"k": 1}})


@pytest.mark.parametrize("declared", [[], "q8_0", {"attn_rotation": True}, {"rope": [1]}])
def test_a_declaration_of_the_wrong_shape_is_bad_input(declared):
    with pytest.raises(BadDeclaration):
        check_declared(info(), declared)


def test_every_declared_field_is_published():
    d = info().as_dict
    for path in DECLARED_FIELDS:
        group, key = path.split(".")
        assert key in d[group], path


# ---- on the wire ---------------------------------------------------------------------------------

async def prefill_blob(client, slot: str, prompt: str) -> bytes:
    pre = await client.request(Op.PREFILL, slot, json.dumps({"prompt": prompt}).encode())
    assert pre.ok, pre.meta
    return bytes(pre.payload[:len(pre.payload) - pre.meta["logits_size"]])


def flipped(kv_cache: dict, key: str = "k") -> dict:
    out = copy.deepcopy(kv_cache)
    out["attn_rotation"][key] = not out["attn_rotation"][key]
    return out


@pytest.mark.asyncio
async def test_decode_v3_compares_the_declared_kv_cache(client):
    kv_cache = (await client.request(Op.INFO)).meta["kv_cache"]
    assert {"k", "v"} <= kv_cache["attn_rotation"].keys()
    kv = await prefill_blob(client, "0", "The quick brown fox")
    md = {"n_past": 0, "tokenizer": "", "model_name": "", "model_quant": "", "model_capabilities": 0}

    def frame(declared) -> bytes:
        return V3.encode_decode_v3({"generation": GEN, "kv_metadata": {**md, "kv_cache": declared}}, b"{}", kv)

    before = (await client.request(Op.STATE_META, "1")).meta["n_past"]
    r = await client.request(Op.DECODE, "1", frame(flipped(kv_cache)))
    assert r.status == Status.BAD_REQUEST, r.meta
    assert r.meta["error"] == "kv_state_mismatch" and r.meta["field"] == "kv_cache.attn_rotation.k"
    assert r.meta["got"] is not kv_cache["attn_rotation"]["k"] and r.meta["want"] is kv_cache["attn_rotation"]["k"]
    assert r.meta["valid"] is False and isinstance(r.meta["decode_request_id"], int)
    assert (await client.request(Op.STATE_META, "1")).meta["n_past"] == before  # nothing restored
    r = await client.request(Op.DECODE, "1", frame("q8_0"))
    assert r.status == Status.BAD_REQUEST and "JSON object" in r.meta["error"], r.meta
    r = await client.request(Op.DECODE, "1", frame(kv_cache))  # the same KV cache: restored, decoding
    assert r.ok and r.meta["valid"] is True, r.meta
    assert r.meta["n_past_after_restore"] > 0


@pytest.mark.asyncio
async def test_http_state_put_compares_x_hydra_kv_cache(http, client):
    await prefill_blob(client, "2", "Pack my box with five dozen")
    async with http.get("/slots/2/state") as r:
        assert r.status == 200
        blob = await r.read()
        declared = json.loads(r.headers["X-Hydra-KV-Cache"])  # what a PUT elsewhere sends back
    kv_cache = (await client.request(Op.INFO)).meta["kv_cache"]
    assert declared == {"attn_rotation": kv_cache["attn_rotation"], "rope": kv_cache["rope"]}
    async with http.put("/slots/0/state", data=blob,
                        headers={"X-Hydra-KV-Cache": json.dumps(flipped(declared, "v"))}) as r:
        body = await r.json()
    assert r.status == 400 and body["restored"] is False and body["reason"] == "kv_state_mismatch", body
    assert body["field"] == "kv_cache.attn_rotation.v" and body["want"] is declared["attn_rotation"]["v"]
    async with http.put("/slots/0/state", data=blob, headers={"X-Hydra-KV-Cache": "[1]"}) as r:
        assert r.status == 400 and (await r.json())["restored"] is False
    async with http.put("/slots/0/state", data=blob, headers={"X-Hydra-KV-Cache": json.dumps(declared)}) as r:
        body = await r.json()
    assert r.status == 200 and body["restored"] is True and body["n_past"] > 0, body
    # without a declaration (as a binary STATE_PUT, which has no place for one) nothing is compared
    async with http.put("/slots/0/state", data=blob) as r:
        assert r.status == 200
    put = await client.request(Op.STATE_PUT, "0", blob)
    assert put.ok and put.meta["restored"], put.meta
