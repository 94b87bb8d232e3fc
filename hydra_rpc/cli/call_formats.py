"""``hydra-rpc call --describe OP``: the request formats each opcode takes, with a command each.

The CONFIGURE key lists come from the engine's own parameter table, so this text cannot promise
a key the engine does not classify that way.
"""
from __future__ import annotations

import shlex
import sys
import textwrap

from codec.enums import ENGINE_OPS, Op, op_name
from engine import tiers
from engine.params_table import PARAMS



def _python() -> str:
    """The interpreter hydra-rpc runs in, the one that can import ``codec`` (a bare ``python``
    outside the venv cannot); its whole path, so the command works from any directory."""
    return shlex.quote(sys.executable)


# Binary payloads are built with the codec's own encoders and piped in on stdin.
_PY = _python() + " -c 'import sys; from codec.{mod} import {fn}; sys.stdout.buffer.write({call})'"


def _py(mod: str, fn: str, call: str) -> str:
    return _PY.format(mod=mod, fn=fn, call=call)


_SLOT = "The key is the slot number (0, 1, …)."

_FORMATS: dict[int, str] = {
    Op.INFO: """\
No payload; the key is ignored. The reply meta describes the engine: model identity, slots,
reload state, config_generation.
  hydra-rpc call INFO | jq .model_name""",
    Op.STATE_META: f"""\
No payload. {_SLOT} The reply meta is that slot's n_past, state size and identity; it never
waits for a decode in progress.
  hydra-rpc call STATE_META --key 0""",
    Op.STATE_GET: f"""\
No payload. {_SLOT} The reply payload is the slot's KV state as a v3 blob (header, tokens,
llama.cpp state); --out saves it.
  hydra-rpc call STATE_GET --key 0 --out slot0.kv""",
    Op.STATE_PUT: f"""\
{_SLOT} The payload is a KV blob (v1, v2 or v3, optionally followed by the logits), e.g. one
saved from STATE_GET or PREFILL.
  hydra-rpc call STATE_PUT --key 1 --payload-file slot0.kv""",
    Op.PREFILL: f"""\
{_SLOT} Two dialects, told apart by the payload:
  JSON   {{"messages":[…]}} (chat, through the model's template) or {{"prompt":"…"}} (raw text),
         optional "model" (an alias) and "hydra_config" (CONFIGURE keys). The reply meta has
         n_past and kv_hash_str; the payload is the KV blob (--out saves it).
    hydra-rpc call PREFILL --key 0 --json '{{"prompt":"The capital of France is"}}'
  E1     raw little-endian u32 token ids; the reply meta is {{"n_past": N}}.
    {_py("payloads", "encode_e1_tokens", "encode_e1_tokens([2, 100, 200])")} \\
      | hydra-rpc call PREFILL --key 0 --payload-file -""",
    Op.DECODE: f"""\
{_SLOT} Four dialects, told apart by the payload:
  PIN     {{"n_predict":N,"messages":[…] or null}}: the reply is OK with no meta, then the
          text streams piece by piece until the server closes (null continues the slot).
    hydra-rpc call DECODE --key 0 --json '{{"n_predict":32,"messages":null}}'
  frames  the same JSON with "stream":false: meta {{tokens_generated,n_past,stop_reason}} and
          9-byte [u32 token][f32 logprob][u8 flags] frames, summarised on stderr.
    hydra-rpc call DECODE --key 0 --json '{{"n_predict":8,"messages":null,"stream":false}}'
  E1      [i32 n_predict][i32 token…]: greedy, the reply payload is the UTF-8 text (--raw).
    {_py("payloads", "encode_e1_decode", "encode_e1_decode(8, [])")} \\
      | hydra-rpc call DECODE --key 0 --payload-file - --raw
  v3      merged DECODE: [u32 hdr_len][u64 xxh3][JSON control header][prompt][kv blob]; the
          meta has decode_request_id, the result is at GET /v1/decode/{{id}} on the HTTP side.
    {_python()} -c 'import json, sys; from codec.decode_v3 import encode_decode_v3
    prompt = json.dumps([{{"role": "user", "content": "hi"}}]).encode()
    kv = open("slot0.kv", "rb").read()  # from STATE_GET --out or PREFILL --out
    sys.stdout.buffer.write(encode_decode_v3({{"generation": {{"n_predict": 8}}}}, prompt, kv))' \\
      | hydra-rpc call DECODE --key 0 --payload-file -""",
    Op.SET_EXPERT_MODE: """\
The payload is the text solo or combined, or JSON {"mode":"solo"|"combined","peer":"HOST:PORT"}.
  hydra-rpc call SET_EXPERT_MODE --text solo""",
    Op.SWAP_QUANT: f"""\
The payload is [u16 qk_len][qk][tensor pattern]: qk names a --model-alias to swap to.
  {_py("payloads", "encode_swap_quant", 'encode_swap_quant("q8", ".*")')} \\
    | hydra-rpc call SWAP_QUANT --payload-file -""",
    Op.PIPELINE_ATTACH: """\
The payload is JSON {"peer":"HOST:PORT","ot_split":"<regex>"} (accepted, not acted on).
  hydra-rpc call PIPELINE_ATTACH --key 0 --json '{"peer":"127.0.0.1:9504","ot_split":""}'""",
}


def _keys(names) -> str:
    return ", ".join(sorted(names))


def _configure() -> str:
    by_tier: dict[str, list[str]] = {}
    for p in PARAMS:
        if p.config and p.key not in tiers.NO_EFFECT:
            by_tier.setdefault(p.tier, []).extend((p.key, *p.aliases))
    wrap = lambda label, text: textwrap.fill(text, 96, initial_indent=f"  {label:<4}", subsequent_indent=" " * 6)
    return "\n".join([
        "The payload is a JSON object of keys (empty = {}); values are typed as llama.cpp types them",
        "(docs/llama-args.md). The reply lists params_applied, deferred_keys, rejected_keys (with",
        "reasons: a wrong type or range, denied, no effect) and unrecognized_keys, and the tier reached.",
        wrap("T1", f"applied at once to later requests: {_keys(by_tier['T1'])} "
                   '(sampling keys also nest: {"sampling":{"temp":0.7}})'),
        wrap("T2", f"a new context, same weights (the old one serves meanwhile): {_keys(by_tier['T2'])}"),
        wrap("T3", f"a new model, built beside the old one: {_keys(by_tier['T3'])}"),
        wrap("T4", f"other llama.cpp parameters, also a reload: {_keys(by_tier['T4'])}"),
        wrap("no", f"refused, as by the C++ engine: {_keys(by_tier['startup'])}; "
                   f"no effect here: {_keys(tiers.NO_EFFECT)}"),
        "  hydra-rpc call CONFIGURE --json '{\"temp\":0.7,\"top_k\":20,\"n_predict\":64}'",
        "  hydra-rpc call CONFIGURE --json '{\"n_ctx\":8192,\"flash_attn\":\"on\",\"cache_type_k\":\"q8_0\"}'",
    ])


def describe(op: int) -> str:
    """What ``op`` takes, for humans: its payload formats and a working command for each."""
    head = f"{op_name(op)} (0x{op:02X})"
    if op == Op.CONFIGURE:
        return f"{head}\n{_configure()}\n"
    if op in _FORMATS:
        return f"{head}\n{_FORMATS[op]}\n"
    return (f"{head}\nNot an engine opcode: this server answers ERROR (Hydra Store and retired agent opcodes).\n"
            f"Engine opcodes: {', '.join(op_name(o) for o in sorted(ENGINE_OPS))}.\n")
