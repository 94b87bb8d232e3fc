"""What every generated model shares (``engine.model_files``' llama ones, ``engine.model_kinds``'
other architectures): the generator version in its file's hash, the SPM vocabulary, the
tokenizer's GGUF keys and the chat template. Its own module, so that neither generator
imports the other for them."""
from __future__ import annotations

import string
from typing import Any

#: Bump whenever the bytes written for the same parameters change: by the llama generator
#: (engine.model_files) or by what is here. It is in every generated file's hash (the other
#: kinds add their own KINDS_VERSION).
GENERATOR_VERSION = 1

SPIECE_UNDERLINE = "\u2581"  # '▁', what SentencePiece uses for a space

#: The tiny models' chat template (deliberately different from llama_backend's fallback format).
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """SPM vocab: <unk> <s> </s>, 256 byte tokens, '▁', printable ASCII, '▁x', bigrams, fillers.

    Returns (tokens, scores, token_types) with exactly ``n_vocab`` entries.
    """
    import gguf

    tt = gguf.TokenType
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [int(tt.UNKNOWN), int(tt.CONTROL), int(tt.CONTROL)]
    scores: list[float] = [0.0, 0.0, 0.0]
    for b in range(256):  # byte fallback; also provides the LF token llama.cpp looks up
        tokens.append(f"<0x{b:02X}>")
        types.append(int(tt.BYTE))
        scores.append(0.0)

    candidates: list[str] = [SPIECE_UNDERLINE]
    candidates += [c for c in string.printable if c not in " \t\n\r\x0b\x0c"]
    candidates += [SPIECE_UNDERLINE + c for c in string.ascii_letters + string.digits]
    candidates += (
        "th he in er an re on at en nd ti es or te of ed is it al ar st to nt ng se ha as ou io "
        "le ve co me de hi ri ro ic ne ea ra ce li ch ll be ma si om ur"
    ).split()
    candidates += [
        SPIECE_UNDERLINE + w
        for w in "the of and to in is it that for on was with as be at by this are or from".split()
    ]
    candidates += [a + b for a in string.ascii_lowercase for b in string.ascii_lowercase]

    need = n_vocab - len(tokens)
    if need < 1:
        raise ValueError(f"n_vocab must be > {len(tokens)}")
    seen = set(tokens)
    pieces: list[str] = []
    for p in candidates:
        if p not in seen:
            seen.add(p)
            pieces.append(p)
    i = 0
    while len(pieces) < need:  # large vocab: pad with unique filler pieces
        p = f"{SPIECE_UNDERLINE}tok{i}"
        i += 1
        if p not in seen:
            seen.add(p)
            pieces.append(p)
    for rank, p in enumerate(pieces[:need]):
        tokens.append(p)
        types.append(int(tt.NORMAL))
        # SPM prefers higher scores: longer pieces win over single characters
        scores.append(-float(rank) if len(p) == 1 else float(len(p)) * 10.0 - rank * 1e-3)
    return tokens, scores, types


def add_tiny_tokenizer(w: Any, tokens: list[str], scores: list[float], types: list[int],
                       add_space_prefix: bool = False) -> None:
    """The generated models' SPM tokenizer (``build_vocab``) and chat template, in GGUF keys."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    # False (like Gemma): detokenize(tokenize(s)) == s exactly. True (Llama-2 style) prepends '▁'.
    w.add_add_space_prefix(add_space_prefix)
    w.add_chat_template(TINY_CHAT_TEMPLATE)
