"""GBNF grammars from JSON schemas and OpenAI ``response_format`` (tools: ``tool_grammar``).

Pure Python: JSON schemas go through llama-cpp-python's ``SchemaConverter`` (a port of
llama.cpp's json-schema-to-grammar), with two changes that keep its output inside what the
sampler accepts: length and item-count bounds become GBNF ``{m,n}`` repetitions instead of
one nested group per allowed item, and a schema that constrains nothing means any JSON value.
Integer bounds (``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``), which
the Python port ignores, are enforced as llama.cpp's C++ converter does (``build_min_max_int``).
Every input is bounded before it is converted; every refusal is a ``ValueError`` naming what is
wrong.
"""
from __future__ import annotations

import json
import re
from typing import Any

from llama_cpp.llama_grammar import RESERVED_NAMES, SchemaConverter

from ..sampling import GrammarSpec, grammar_nesting
from .int_range import INT_BOUNDS, int_bounds, int_range_rule

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_REPEAT = 2000  # llama.cpp's parser refuses larger {m,n}; a larger maximum is not enforced
MAX_NESTING = 64  # what the sampler's grammar check allows
ANY_VALUE = {"type": ["string", "number", "boolean", "object", "array", "null"]}
# keywords that make the converter constrain something; a schema with none of them is "any"
_CONSTRAINING = {"type", "$ref", "oneOf", "anyOf", "allOf", "const", "enum", "properties",
                 "additionalProperties", "items", "prefixItems", "pattern", "format"}
# integer bounds: the unbounded integer rule allows at most 16 digits, so do the bounded ones


# ---- JSON schema → GBNF -------------------------------------------------------------------
def _check_shape(node: Any, depth: int, where: str) -> None:
    """Depth bound, and only local ``$ref``s (the converter would fetch remote ones)."""
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"schema nests deeper than {MAX_SCHEMA_DEPTH} at {where}")
    if isinstance(node, dict):
        ref = node.get("$ref")
        if ref is not None and (not isinstance(ref, str) or not ref.startswith("#/")):
            raise ValueError(f"schema $ref {ref!r} at {where} is not a local reference (#/...)")
        for k, v in node.items():
            _check_shape(v, depth + 1, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_shape(v, depth + 1, f"{where}/{i}")


_SUBSCHEMA = {"items", "additionalProperties", "not", "if", "then", "else", "contains"}
_SUBSCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SUBSCHEMA_MAPS = {"properties", "$defs", "definitions"}


def _schema(node: Any, defs_prefix: str = "") -> Any:
    """``true``/``{}``/annotation-only subschemas → any value (the converter takes ``{}`` for an
    object and fails on the others); ``$defs`` names get ``defs_prefix`` so that several schemas
    share one converter without their definitions colliding."""
    if node is True or (isinstance(node, dict) and not (_CONSTRAINING & node.keys())):
        return dict(ANY_VALUE)
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _SUBSCHEMA and isinstance(v, (dict, bool)):
            v = v if v is False else _schema(v, defs_prefix)
        elif k in _SUBSCHEMA_LISTS and isinstance(v, list):
            v = [_schema(x, defs_prefix) for x in v]
        elif k in _SUBSCHEMA_MAPS and isinstance(v, dict):
            pre = defs_prefix if k != "properties" else ""
            v = {pre + name: _schema(x, defs_prefix) for name, x in v.items()}
        elif k == "$ref" and isinstance(v, str) and defs_prefix:
            v = re.sub(r"^#/(\$defs|definitions)/", lambda m: m.group(0) + defs_prefix, v)
        out[k] = v
    return out


# JSON's string character as llama.cpp's C++ converter writes it: the Python port's rule lets
# control characters through unescaped, which no JSON parser accepts
JSON_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'


class _Converter(SchemaConverter):
    """``SchemaConverter`` with flat ``{m,n}`` repetitions for string lengths and array sizes,
    integer bounds enforced, and JSON's own string characters."""

    def _add_primitive(self, name: str, rule: Any) -> str:
        if name == "char":
            rule = type(rule)(JSON_CHAR, [])
        return super()._add_primitive(name, rule)

    def visit(self, schema: Any, name: str) -> str:
        if not isinstance(schema, dict):
            raise ValueError(f"subschema {name or 'root'} is not an object")
        rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
        plain = not ({"$ref", "oneOf", "anyOf", "allOf", "const", "enum"} & schema.keys())
        kind = schema.get("type")
        if plain and kind == "string" and not ({"pattern", "format"} & schema.keys()) and (
                "minLength" in schema or "maxLength" in schema):
            char = self._add_primitive("char", _prim("char"))
            rep = _repeat(schema, "minLength", "maxLength")
            return self._add_rule(rule_name, f'"\\"" {char}{rep} "\\"" space')
        if plain and kind == "array" and isinstance(schema.get("items"), dict) and (
                "minItems" in schema or "maxItems" in schema):
            item = self.visit(schema["items"], f"{name}{'-' if name else ''}item")
            return self._add_rule(rule_name, _array_rule(item, schema))
        bounded = plain and any(k in schema for k in INT_BOUNDS)
        if bounded and kind == "integer":
            lo, hi = int_bounds(schema)
            return self._add_rule(rule_name, f"({int_range_rule(lo, hi)}) space")
        if bounded and isinstance(kind, list) and "integer" in kind:
            # the port's union of types keeps only "type": the integer member keeps its bounds
            bounds = {k: schema[k] for k in INT_BOUNDS if k in schema}
            alts = [{"type": t, **(bounds if t == "integer" else {})} for t in kind]
            return self._add_rule(rule_name, self._generate_union_rule(name, alts))
        # "type": "number" with bounds stays unconstrained by them, as in llama.cpp
        return super().visit(schema, name)


def _prim(name: str) -> Any:
    from llama_cpp.llama_grammar import PRIMITIVE_RULES

    return PRIMITIVE_RULES[name]


def _bounds(schema: dict, lo_key: str, hi_key: str) -> tuple[int, int | None]:
    lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
    if not isinstance(lo, int) or lo < 0 or lo > MAX_REPEAT:
        raise ValueError(f"schema {lo_key} must be an integer in 0..{MAX_REPEAT}")
    if hi is not None and (not isinstance(hi, int) or hi < lo):
        raise ValueError(f"schema {hi_key} must be an integer >= {lo_key}")
    return lo, (None if hi is None or hi > MAX_REPEAT else hi)


def _repeat(schema: dict, lo_key: str, hi_key: str, shift: int = 0) -> str:
    lo, hi = _bounds(schema, lo_key, hi_key)
    lo, hi = max(0, lo - shift), (None if hi is None else max(0, hi - shift))
    return f"{{{lo},}}" if hi is None else f"{{{lo},{hi}}}"


def _array_rule(item: str, schema: dict) -> str:
    lo, hi = _bounds(schema, "minItems", "maxItems")
    if hi == 0:
        return '"[" space "]" space'
    more = f'("," space {item}){_repeat(schema, "minItems", "maxItems", shift=1)}'
    body = f"{item} {more}"
    return f'"[" space {body if lo >= 1 else f"({body})?"} "]" space'


def _convert(schema: Any, name: str, conv: _Converter) -> str:
    """Visit one (already bounded) schema; the converter's failures become ValueErrors."""
    try:
        schema = conv.resolve_refs(schema, "input")
        return conv.visit(schema, name)
    except ValueError:
        raise
    except Exception as e:  # AssertionError, KeyError, TypeError, re.error from its internals
        raise ValueError(f"unsupported JSON schema: {e or type(e).__name__}") from None


def _bounded_copy(schema: Any, what: str = "schema", defs_prefix: str = "") -> Any:
    if not isinstance(schema, dict):
        raise ValueError(f"{what} must be a JSON object")
    try:
        raw = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON: {e}") from None
    if len(raw.encode()) > MAX_SCHEMA_BYTES:
        raise ValueError(f"{what} is larger than {MAX_SCHEMA_BYTES} bytes")
    _check_shape(schema, 0, what)
    return _schema(json.loads(raw), defs_prefix)


def _finish(text: str, max_bytes: int) -> str:
    if len(text.encode()) > max_bytes:
        raise ValueError(f"the grammar for this schema is larger than {max_bytes} bytes")
    if grammar_nesting(text) > MAX_NESTING:
        raise ValueError(f"the grammar for this schema nests deeper than {MAX_NESTING}")
    return text


def schema_to_gbnf(schema: dict, *, max_bytes: int = 64 * 1024) -> str:
    """A GBNF grammar (root rule ``root``) for JSON values that satisfy ``schema``.

    Objects keep the schema's property order, required properties mandatory, no other
    properties unless ``additionalProperties`` allows them; ``$ref`` must be local. Raises
    ``ValueError`` for a schema over 64 KiB, nested deeper than 32, unsupported, or whose
    grammar exceeds ``max_bytes``.
    """
    conv = _new_converter()
    _convert(_bounded_copy(schema), "", conv)
    return _finish(conv.format_grammar(), max_bytes)


def _new_converter() -> _Converter:
    return _Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


# ---- response_format ----------------------------------------------------------------------
def response_format_grammar(response_format: Any) -> GrammarSpec | None:
    """OpenAI ``response_format`` → a grammar: ``text`` → None, ``json_object`` (optionally with
    llama-server's ``schema``) → any JSON object or that schema, ``json_schema`` → its
    ``json_schema.schema``. Anything else → ``ValueError``."""
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema", {"type": "object"})
        return GrammarSpec(schema_to_gbnf(schema))
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be an object")
        return GrammarSpec(schema_to_gbnf(schema))
    raise ValueError(f"response_format.type must be text, json_object or json_schema, not {kind!r}")
