#!/usr/bin/env python3
"""Generate llama-server's argument table from llama.cpp's own ``common/arg.cpp``.

The table is llama.cpp's, for the llama.cpp vendored in the pinned llama-cpp-python, not
a hand-picked subset: every ``add_opt(common_arg(...))`` that llama-server registers
(``LLAMA_EXAMPLE_SERVER`` or ``LLAMA_EXAMPLE_COMMON``, and not excluded from the server)
with its names, negative forms, value placeholders, handler kind, ``LLAMA_ARG_*``
variable and help text.

Two outputs, both kept in the repository so nothing downloads at run or test time:

* ``hydra_rpc/cli/llama_args_data.py`` — the table as data (needs the sdist to regenerate);
* ``docs/llama-args.md`` — the table with each argument's status here (applied / accepted
  without effect / refused), from the data plus ``hydra_rpc/cli/llama_args.py``.

Usage::

    python scripts/gen_llama_args.py                 # pip-download the pinned sdist, regenerate both
    python scripts/gen_llama_args.py --sdist FILE    # a downloaded sdist (.tar.gz) or its unpacked dir
    python scripts/gen_llama_args.py --docs-only     # only docs/llama-args.md, from the committed data
    python scripts/gen_llama_args.py --check         # exit 1 if a committed output is out of date

The parser understands the C++ this file is written in (string, char and raw-string
literals, comments, nested brackets) and the one ``if (ex == LLAMA_EXAMPLE_SERVER) {...}
else {...}`` construct it uses; anything else it does not understand fails loudly, so a
llama.cpp bump that changes the file's shape cannot silently drop arguments.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA_FILE = REPO / "hydra_rpc" / "llama_args_data.py"
DOCS_FILE = REPO / "docs" / "llama-args.md"
PACKAGE = "llama-cpp-python"
PACKAGE_VERSION = "0.3.36"
ARG_CPP = "vendor/llama.cpp/common/arg.cpp"
SERVER = "LLAMA_EXAMPLE_SERVER"
COMMON = "LLAMA_EXAMPLE_COMMON"


class ArgCppError(ValueError):
    """arg.cpp has a shape this generator does not understand."""


# ---- a small C++ tokenizer ------------------------------------------------------------------

@dataclass(frozen=True)
class Tok:
    kind: str  # "str" (value = the decoded literal), "id", "num", "op"
    value: str
    src: str  # the source text, for rendering expressions


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "0": "\0", "r": "\r", "a": "\a"}
_ID = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_NUM = re.compile(r"[0-9][0-9A-Za-z_.']*")
_OPS = ("::", "==", "!=", "<=", ">=", "&&", "||", "->", "++", "--", "+=", "-=", "<<", ">>")


def tokenize(text: str) -> list[Tok]:
    out: list[Tok] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                raise ArgCppError("unterminated comment")
            i = end + 2
        elif text.startswith('R"', i):
            paren = text.index("(", i)
            delim = ")" + text[i + 2:paren] + '"'
            end = text.index(delim, paren)
            out.append(Tok("str", text[paren + 1:end], text[i:end + len(delim)]))
            i = end + len(delim)
        elif c in "\"'":
            j, buf = i + 1, []
            while text[j] != c:
                if text[j] == "\\":
                    buf.append(_ESCAPES.get(text[j + 1], text[j + 1]))
                    j += 2
                else:
                    buf.append(text[j])
                    j += 1
            out.append(Tok("str" if c == '"' else "chr", "".join(buf), text[i:j + 1]))
            i = j + 1
        elif m := _ID.match(text, i):
            out.append(Tok("id", m.group(), m.group()))
            i = m.end()
        elif m := _NUM.match(text, i):
            out.append(Tok("num", m.group(), m.group()))
            i = m.end()
        else:
            op = next((o for o in _OPS if text.startswith(o, i)), c)
            out.append(Tok("op", op, op))
            i += len(op)
    return out


_OPEN, _CLOSE = {"(": ")", "[": "]", "{": "}"}, {")", "]", "}"}


def matching(toks: list[Tok], i: int) -> int:
    """Index of the bracket closing the one at ``toks[i]``."""
    depth = 0
    for j in range(i, len(toks)):
        t = toks[j]
        if t.kind == "op" and t.value in _OPEN:
            depth += 1
        elif t.kind == "op" and t.value in _CLOSE:
            depth -= 1
            if depth == 0:
                return j
    raise ArgCppError(f"unbalanced {toks[i].value!r}")


def split_top(toks: list[Tok], sep: str = ",") -> list[list[Tok]]:
    """Split a token list on ``sep`` at bracket depth 0."""
    parts: list[list[Tok]] = [[]]
    depth = 0
    for t in toks:
        if t.kind == "op" and t.value in _OPEN:
            depth += 1
        elif t.kind == "op" and t.value in _CLOSE:
            depth -= 1
        if depth == 0 and t.kind == "op" and t.value == sep:
            parts.append([])
        else:
            parts[-1].append(t)
    return [p for p in parts if p] if parts != [[]] else []


def src(toks: list[Tok]) -> str:
    text = " ".join(t.src for t in toks)
    return re.sub(r"\s*(::|\.|->)\s*", r"\1", re.sub(r"\s*([(),\[\]])\s*", r"\1", text))


# ---- one add_opt(...) ------------------------------------------------------------------------

@dataclass
class Arg:
    names: list[str]
    negative: list[str] = field(default_factory=list)
    value_hint: str | None = None
    value_hint_2: str | None = None
    handler: str = "void"  # void | bool | int | string | string2
    env: str | None = None
    examples: list[str] = field(default_factory=lambda: [COMMON])
    excludes: list[str] = field(default_factory=list)
    sampling: bool = False
    spec: bool = False
    preset_only: bool = False
    conversion: str | None = None  # stoi/stoul/stof/stod: how a string handler reads its whole value
    help: str = ""

    def in_server(self) -> bool:
        return (SERVER in self.examples or COMMON in self.examples) and SERVER not in self.excludes


def _string_list(toks: list[Tok]) -> list[str]:
    inner = toks[1:-1]
    items = split_top(inner)
    if any(len(p) != 1 or p[0].kind != "str" for p in items):
        raise ArgCppError(f"not a list of string literals: {src(toks)}")
    return [p[0].value for p in items]


def _examples(toks: list[Tok], lists: dict[str, list[str]]) -> list[str]:
    if len(toks) == 1 and toks[0].kind == "id" and toks[0].value in lists:
        return list(lists[toks[0].value])
    if toks[0].value != "{":
        raise ArgCppError(f"unknown example list {src(toks)}")
    return [src(p) for p in split_top(toks[1:-1])]


def _is_string_expr(toks: list[Tok]) -> bool:
    """Adjacent literals, possibly with ``<cinttypes>`` macros (``"%" PRIu32``)."""
    return all(t.kind == "str" or t.kind == "id" and t.value.startswith("PRI") for t in toks)


def _literal(toks: list[Tok]) -> str:
    return "".join(t.value if t.kind == "str" else t.value[-3:-2] or "d" for t in toks)


_FMT = re.compile(r"%[-+ #0]*\d*(?:\.\d+)?(?:hh|h|ll|l|z|j|t|L)?[diouxXeEfgGcsp%]")


def render_help(toks: list[Tok], cond) -> str:
    """Best-effort text of a help expression: literals verbatim, ``%`` conversions of
    ``string_format`` shown as ``{expression}`` (the default the C++ would print)."""
    parts = split_top(toks, "+")
    if len(parts) > 1:
        return "".join(render_help(p, cond) for p in parts)
    if _is_string_expr(toks):
        return _literal(toks)
    q = next((i for i, t in enumerate(toks) if t.kind == "op" and t.value == "?"), None)
    if q is not None and toks[0].kind == "id" and toks[0].value == "ex":
        colon = next(i for i in range(q + 1, len(toks)) if toks[i].value == ":")
        return render_help(toks[q + 1:colon] if cond(toks[:q]) else toks[colon + 1:], cond)
    if toks[0].kind == "id" and toks[0].value == "string_format" and toks[1].value == "(":
        args = split_top(toks[2:matching(toks, 1)])
        fmt = render_help(args[0], cond)
        values = iter(args[1:])

        def sub(m: re.Match) -> str:
            if m.group() == "%%":
                return "%"
            v = next(values, None)
            if v is None:
                return m.group()
            return _literal(v) if _is_string_expr(v) else "{" + re.sub(r"\bparams\.", "", src(v)) + "}"

        return _FMT.sub(sub, fmt)
    if len(toks) >= 2 and toks[0].kind == "id" and toks[-1].value == ")":
        return "{" + src(toks) + "}"  # e.g. list_builtin_chat_templates()
    return "{" + src(toks) + "}"


_CONVERSIONS = ("stoi", "stoul", "stof", "stod")


def _conversion(body: list[Tok], value: str) -> str | None:
    """The ``std::sto*`` a string handler applies to its whole value, when that is all it
    does with it (no comparisons, no other conversion): the value's type in llama.cpp."""
    calls = [i for i, t in enumerate(body) if t.value in _CONVERSIONS and body[i - 1].value == "::"]
    if len(calls) != 1 or any(t.value == "==" for t in body):
        return None
    i = calls[0]
    return body[i].value if [t.value for t in body[i + 1:i + 4]] == ["(", value, ")"] else None


def parse_common_arg(toks: list[Tok], chain: list[Tok], lists: dict[str, list[str]], cond) -> Arg:
    """``toks``: the arguments inside ``common_arg(...)``; ``chain``: ``.set_x(...)...``."""
    items = split_top(toks)
    lists_ = [p for p in items if p[0].value == "{" and p[0].kind == "op"]
    if not lists_ or items[0] is not lists_[0]:
        raise ArgCppError(f"common_arg without a name list: {src(toks)[:80]}")
    arg = Arg(names=_string_list(items[0]))
    rest = items[1:]
    if rest and rest[0][0].kind == "op" and rest[0][0].value == "{":
        arg.negative = _string_list(rest[0])
        rest = rest[1:]
    if len(rest) < 2 or rest[-1][0].value != "[":
        raise ArgCppError(f"common_arg {arg.names} has no handler lambda")
    lam = rest[-1]
    params = lam[matching(lam, 0) + 1:]
    body = params[matching(params, 0) + 1:]
    params = split_top(params[1:matching(params, 0)])
    if len(params) == 1:
        arg.handler = "void"
    elif len(params) == 3:
        arg.handler = "string2"
    else:
        ptype = src(params[1][:-1]) if len(params[1]) > 1 else src(params[1])
        arg.handler = "int" if ptype == "int" else "bool" if ptype == "bool" else "string"
        if "string" not in ptype and arg.handler == "string":
            raise ArgCppError(f"unknown handler parameter type {ptype!r} for {arg.names}")
        if arg.handler == "string":
            arg.conversion = _conversion(body, params[1][-1].value)
    hints = rest[:-2]
    if len(hints) > 2:
        raise ArgCppError(f"unexpected value hints for {arg.names}")
    if hints:  # a literal, or an expression such as common_speculative_all_types_str()
        arg.value_hint = render_help(hints[0], cond)
    if len(hints) == 2:
        arg.value_hint_2 = render_help(hints[1], cond)
    expected = {"void": 0, "bool": 0, "int": 1, "string": 1, "string2": 2}[arg.handler]
    if len(hints) != expected or (arg.handler == "bool") != bool(arg.negative):
        raise ArgCppError(f"handler {arg.handler} does not fit the constructor of {arg.names}")
    arg.help = render_help(rest[-2], cond)
    i = 0
    while i < len(chain):
        if chain[i].value != "." or chain[i + 1].kind != "id" or chain[i + 2].value != "(":
            raise ArgCppError(f"unexpected {src(chain[i:i + 3])} after common_arg {arg.names}")
        name, close = chain[i + 1].value, matching(chain, i + 2)
        inner = chain[i + 3:close]
        if name == "set_examples":
            arg.examples = _examples(inner, lists)
        elif name == "set_excludes":
            arg.excludes = _examples(inner, lists)
        elif name == "set_env":
            if len(inner) != 1 or inner[0].kind not in ("str", "id"):
                raise ArgCppError(f"set_env of {arg.names}: {src(inner)}")
            arg.env = inner[0].value
        elif name in ("set_sampling", "set_spec", "set_preset_only"):
            setattr(arg, {"set_sampling": "sampling", "set_spec": "spec"}.get(name, "preset_only"), True)
        else:
            raise ArgCppError(f"unknown common_arg method {name} on {arg.names}")
        i = close + 1
    return arg


# ---- the function body: add_opt calls under if (ex == ...) --------------------------------

def _if_end(toks: list[Tok], i: int) -> int:
    """Index just past an ``if (...) {...} [else if (...) {...}]* [else {...}]`` chain at ``i``."""
    while True:
        i = matching(toks, i + 1) + 1  # past the condition
        i = matching(toks, i) + 1  # past the block
        if i < len(toks) and toks[i].value == "else":
            if toks[i + 1].value == "if":
                i += 1
                continue
            return matching(toks, i + 1) + 1
        return i


def _eval_cond(toks: list[Tok], chain: list[Tok] | None = None) -> bool:
    """Conditions on the example being built; only ``ex ==/!= LLAMA_EXAMPLE_X`` (with || / &&).

    An ``if`` chain that registers no option may test anything (it is skipped as a whole).
    """
    if chain and not any(t.value == "add_opt" for t in chain):
        return False
    for op, fn in (("||", any), ("&&", all)):
        parts = split_top(toks, op)
        if len(parts) > 1:
            return fn(_eval_cond(p) for p in parts)
    if len(toks) == 3 and toks[0].value == "ex" and toks[1].value in ("==", "!=") and toks[2].kind == "id":
        return (toks[2].value == SERVER) == (toks[1].value == "==")
    raise ArgCppError(f"unsupported condition {src(toks)!r}")


def example_lists(toks: list[Tok]) -> dict[str, list[str]]:
    """``static std::initializer_list<enum llama_example> NAME = {...};`` at file scope."""
    out = {}
    for i, t in enumerate(toks):
        if t.value == "initializer_list" and toks[i + 1].value == "<" and i > 2 and toks[i - 3].value == "static":
            j = next(k for k in range(i, len(toks)) if toks[k].value == "=")
            out[toks[j - 1].value] = [src(p) for p in split_top(toks[j + 2:matching(toks, j + 1)])]
    return out


def parse_arg_cpp(text: str) -> list[Arg]:
    """Every option ``common_params_parser_init`` registers for llama-server, in file order."""
    toks = tokenize(text)
    lists = example_lists(toks)
    start = next((i for i, t in enumerate(toks) if t.value == "common_params_parser_init"
                  and toks[i - 1].value == "common_params_context"), None)
    if start is None:
        raise ArgCppError("common_params_parser_init not found")
    body_open = next(i for i in range(start, len(toks)) if toks[i].value == "{")
    body = toks[body_open + 1:matching(toks, body_open)]
    out: list[Arg] = []
    _walk(body, True, lists, out)
    if not out:
        raise ArgCppError("no add_opt calls found")
    return out


def _walk(toks: list[Tok], active: bool, lists: dict[str, list[str]], out: list[Arg]) -> None:
    i = 0
    while i < len(toks):
        t = toks[i]
        if t.value == "add_opt" and toks[i + 1].value == "(" and toks[i + 2].value == "common_arg":
            end = matching(toks, i + 1)
            ca_close = matching(toks, i + 3)
            arg = parse_common_arg(toks[i + 4:ca_close], toks[ca_close + 1:end], lists, _eval_cond)
            if active and arg.in_server():
                out.append(arg)
            i = end + 2  # past ");"
        elif t.value == "if" and t.kind == "id":
            branch_active = _eval_cond(toks[i + 2:matching(toks, i + 1)], toks[i:_if_end(toks, i)])
            i = matching(toks, i + 1) + 1
            taken = False
            while True:
                if toks[i].value != "{":
                    raise ArgCppError("if without braces")
                close = matching(toks, i)
                _walk(toks[i + 1:close], active and branch_active and not taken, lists, out)
                taken = taken or branch_active
                i = close + 1
                if i < len(toks) and toks[i].value == "else":
                    if toks[i + 1].value == "if":
                        branch_active = _eval_cond(toks[i + 3:matching(toks, i + 2)], [])
                        i = matching(toks, i + 2) + 1
                    else:
                        branch_active = True
                        i += 1
                    continue
                break
        elif t.value in ("{", "(", "["):
            i = matching(toks, i) + 1
        else:
            if t.value == "add_opt" and toks[i - 1].value != "auto":  # (the lambda's own definition)
                raise ArgCppError("add_opt in a form this generator does not know")
            i += 1


# ---- outputs -------------------------------------------------------------------------------

def render_data(args: list[Arg], sha256: str) -> str:
    lines = [
        '"""llama-server\'s argument table (GENERATED by scripts/gen_llama_args.py — do not edit).',
        "",
        f"Source: {ARG_CPP} of the {PACKAGE}=={PACKAGE_VERSION} sdist (sha256 {sha256[:16]}…).",
        "Regenerate: ``python scripts/gen_llama_args.py`` (needs the sdist; see its docstring).",
        "One dict per argument; keys left out have their default: negative (), value_hint None,",
        "value_hint_2 None, env None, examples ('COMMON',), excludes (), sampling False, spec False,",
        "conversion None. handler: void = bare flag, bool = flag with a negative form, int / string =",
        "one value, string2 = two values; conversion: the std::sto* a string handler reads its value with.",
        '"""',
        "",
        f"LLAMA_CPP_SOURCE = {PACKAGE + '==' + PACKAGE_VERSION!r}",
        f"ARG_CPP_SHA256 = {sha256!r}",
        "",
        "SERVER_ARGS = (",
    ]
    defaults = {"negative": (), "value_hint": None, "value_hint_2": None, "env": None, "examples": ("COMMON",),
                "excludes": (), "sampling": False, "spec": False, "conversion": None}
    for a in args:
        entry = {
            "names": tuple(a.names), "handler": a.handler, "negative": tuple(a.negative), "value_hint": a.value_hint,
            "value_hint_2": a.value_hint_2, "env": a.env,
            "examples": tuple(e.removeprefix("LLAMA_EXAMPLE_") for e in a.examples),
            "excludes": tuple(e.removeprefix("LLAMA_EXAMPLE_") for e in a.excludes),
            "sampling": a.sampling, "spec": a.spec, "conversion": a.conversion, "help": a.help,
        }
        kept = ", ".join(f"{k!r}: {v!r}" for k, v in entry.items() if k not in defaults or defaults[k] != v)
        lines.append(f"    {{{kept}}},")
    lines.append(")")
    return "\n".join(lines) + "\n"


def render_docs() -> str:
    sys.path.insert(0, str(REPO))
    from hydra_rpc.cli.llama_args import render_status_markdown

    return render_status_markdown()


def find_arg_cpp(sdist: Path | None) -> tuple[str, str]:
    """(text, sha256) of arg.cpp from an sdist file or directory, or a fresh pip download."""
    if sdist is None:
        tmp = Path(tempfile.mkdtemp(prefix="llama-sdist-"))
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"{PACKAGE}=={PACKAGE_VERSION}", "-d", str(tmp)], check=True)
        sdist = next(tmp.glob("*.tar.gz"))
    if sdist.is_dir():
        path = next(sdist.glob(f"**/{ARG_CPP}"), None) or sdist / ARG_CPP
        data = path.read_bytes()
    else:
        with tarfile.open(sdist) as tf:
            member = next(m for m in tf.getmembers() if m.name.endswith(ARG_CPP))
            data = tf.extractfile(member).read()  # type: ignore[union-attr]
    return data.decode(), hashlib.sha256(data).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, help="the llama-cpp-python sdist (.tar.gz) or its unpacked directory")
    ap.add_argument("--docs-only", action="store_true", help="only regenerate docs/llama-args.md")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if an output is out of date")
    ns = ap.parse_args(argv)
    stale = []
    if not ns.docs_only:
        text, sha = find_arg_cpp(ns.sdist)
        stale += _update(DATA_FILE, render_data(parse_arg_cpp(text), sha), ns.check)
    stale += _update(DOCS_FILE, render_docs(), ns.check)  # reads the data file just written
    for p in stale:
        print(f"{'out of date' if ns.check else 'wrote'}: {p.relative_to(REPO)}", file=sys.stderr)
    return 1 if ns.check and stale else 0


def _update(path: Path, text: str, check: bool) -> list[Path]:
    if path.exists() and path.read_text() == text:
        return []
    if not check:
        path.write_text(text)
    return [path]


if __name__ == "__main__":
    sys.exit(main())
