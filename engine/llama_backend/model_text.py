"""Text and tokens, and chat prompts: the vocabulary side of :class:`LoadedModel`.

A mixin, so that ``LoadedModel`` keeps one flat API (``engine.backend.ModelBackend``) while this
part lives apart from the context, its sequences and the decode. It needs of the host only what
``LoadedModel.__init__`` sets before it calls :meth:`ModelText._init_text`: ``_vocab``,
``_n_vocab`` and ``_closed``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np

import llama_cpp.llama_cpp as L

from ..chat.formats import ChatFormat, detect_format, renders_parallel_calls
from ..chat.turns import tool_result_turns, user_turn_opening
from ..utf8 import utf8_masks
from . import vocab
from .chat_template import ChatTemplate
from .identity import chat_template_source
from .legacy_chat import is_jinja_source, render_builtin
from .runtime import LlamaBackendError


#: llama.cpp's ``common_chat_format_example`` conversation
EXAMPLE_CONVERSATION = [{"role": "system", "content": "You are a helpful assistant"},
                        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"},
                        {"role": "user", "content": "How are you?"}]


PIECES_KEPT = 16384


class ModelText:
    _vocab: Any
    _n_vocab: int
    _closed: bool

    def _init_text(self, model: Any, chat_template: str | None, jinja: bool, chat_kwargs: dict[str, Any] | None,
                   architecture: str) -> None:
        """The chat template: ``chat_template`` when one is given, else the one in ``model``'s file."""
        template = chat_template if chat_template is not None else chat_template_source(model)
        # llama.cpp's own formats: --no-jinja, or a template that names one ("chatml")
        self._builtin_template = template if template and (not jinja or not is_jinja_source(template)) else None
        self.chat = ChatTemplate(None if self._builtin_template else template, architecture)
        self.chat_kwargs = dict(chat_kwargs or {})
        if chat_template is not None:  # one given by the operator or a CONFIGURE (llama-server
            self._check_chat_template()  # refuses an unsupported --chat-template at start too)
        self._chat_syntax: ChatFormat | None = None
        self._user_turn_tokens: list[int] | None = None
        self._tool_result_turns = 0
        self._utf8_masks: np.ndarray | None = None
        self._pieces: list[bytes] | None = None
        # tokens' text, each asked of llama.cpp once (a dict read instead of a call, ~3 µs a
        # generated token); the first PIECES_KEPT asked (~2 MiB), the few thousand a model writes
        self._plain_pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}  # the same for "ends the generation", asked of every token
        self._render_example()

    def _check_chat_template(self) -> None:
        """A template that cannot work fails the build, not the first chat: a jinja source is
        compiled; a built-in name (``chatml``; --no-jinja) is tried on one message, as
        llama.cpp then looks the name up."""
        try:
            if self._builtin_template:
                render_builtin(self._builtin_template, [{"role": "user", "content": "hi"}], True)
            else:
                self.chat.compile()
        except LlamaBackendError as e:
            raise LlamaBackendError(f"chat template: {e}") from None
        except Exception as e:  # jinja2's TemplateError and what its compiler raises
            raise LlamaBackendError(f"chat template does not compile: {type(e).__name__}: {e}") from None

    def _render_example(self) -> None:
        """Render an example conversation once, on the loader thread, as llama-server does at
        start-up (its log's ``example_format``): the file's template is compiled then (4–10 ms;
        the model's first chat paid it), and jinja's first render sets up what later ones
        reuse. A template that refuses this conversation (a strict turn order) or does not
        compile only loses the warm-up: its chats answer as they would have."""
        try:
            self.render_chat(EXAMPLE_CONVERSATION)
        except Exception:
            pass

    def _voc(self) -> Any:
        if self._closed:
            raise LlamaBackendError("model is closed")
        return self._vocab

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def bos(self) -> int:
        return int(L.llama_vocab_bos(self._voc()))

    @property
    def eos(self) -> int:
        return int(L.llama_vocab_eos(self._voc()))

    # ---- tokenization ------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Text -> tokens. ``add_special`` adds BOS (if the model wants it); ``parse_special``
        turns special-token text like ``<s>`` / ``<start_of_turn>`` into those tokens."""
        return vocab.tokenize(self._voc(), text, add_special, parse_special)

    def token_to_piece(self, tok: int, special: bool = False) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 sequence). Control tokens give
        b"" unless ``special``."""
        if special:
            return vocab.token_to_piece(self._voc(), tok, True)
        piece = self._plain_pieces.get(tok)
        if piece is None:
            piece = vocab.token_to_piece(self._voc(), tok, False)
            if len(self._plain_pieces) < PIECES_KEPT:
                self._plain_pieces[tok] = piece
        return piece

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        """Tokens -> raw bytes. Control tokens are dropped unless ``special``."""
        return vocab.detokenize(self._voc(), tokens, special)

    def is_eog(self, tok: int) -> bool:
        eog = self._eog.get(tok)
        if eog is None:
            eog = bool(L.llama_vocab_is_eog(self._voc(), int(tok)))
            if len(self._eog) < PIECES_KEPT:
                self._eog[tok] = eog
        return eog

    # ---- chat template -----------------------------------------------------------------
    @property
    def chat_format(self) -> str:
        return "builtin" if self._builtin_template else self.chat.format

    def _piece_text(self, tok: int) -> str:
        return self.token_to_piece(tok, special=True).decode("utf-8", "replace") if tok >= 0 else ""

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` to prompt text (see :class:`ChatTemplate`).

        Tokenize the result with ``parse_special=True``; :meth:`chat_tokens` does that and
        avoids a doubled BOS when the template itself emits one.
        """
        if self._builtin_template:
            return render_builtin(self._builtin_template, messages, add_generation_prompt)
        return self.chat.render(messages, add_generation_prompt, bos_token=self._piece_text(self.bos),
                                eos_token=self._piece_text(self.eos), **{**self.chat_kwargs, **extra})

    @property
    def chat_syntax(self) -> ChatFormat:
        """The template's tool-call and reasoning format (``engine.chat.formats``)."""
        if self._chat_syntax is None:
            fmt = detect_format(self._builtin_template or self.chat.source)
            self._chat_syntax = replace(fmt, parallel_calls=renders_parallel_calls(self.apply_chat_template))
        return self._chat_syntax

    @property
    def user_turn_tokens(self) -> list[int]:
        """The tokens that open a user turn in this template's prompts (``engine.chat.turns``;
        empty when the template does not show them): a checkpoint goes where the last starts."""
        if self._user_turn_tokens is None:
            self._probe_turns()
        return self._user_turn_tokens

    @property
    def tool_result_turns(self) -> int:
        """Whether this template writes tool results in user turns (``engine.chat.turns``):
        0 no, 1 a run of results in one, 2 one each."""
        if self._user_turn_tokens is None:
            self._probe_turns()
        return self._tool_result_turns

    def _probe_turns(self) -> None:
        def render(messages: list[dict[str, Any]], gen: bool) -> str:
            return self.apply_chat_template(messages, gen)

        opening = user_turn_opening(render)
        self._tool_result_turns = tool_result_turns(render, opening)
        self._user_turn_tokens = self.tokenize(opening, add_special=False, parse_special=True) if opening else []

    def utf8_masks(self) -> np.ndarray:
        """bool[4, n_vocab]: row k says which tokens keep the text valid UTF-8 when it ends
        with k continuation bytes still owed. llama.cpp's grammar decodes a character from its
        lead byte alone, so without this a grammar lets a model write invalid text (and a JSON
        string longer than its maxLength once decoded). Computed on first use."""
        if self._utf8_masks is None:
            self._utf8_masks = utf8_masks(self.token_pieces())
        return self._utf8_masks

    def token_pieces(self) -> list[bytes]:
        """Every token's bytes (special tokens' text included), by id; computed on first use
        (a grammar reads them for every candidate it refines)."""
        if self._pieces is None:
            self._pieces = [self.token_to_piece(t, special=True) for t in range(self.n_vocab)]
        return self._pieces

    def render_chat(self, messages: list[dict[str, Any]], **extra: Any) -> str:
        """The prompt text for ``messages`` with the generation prompt; ``extra`` are template
        variables (``tools``, the request's ``chat_template_kwargs``)."""
        return self.apply_chat_template(messages, True, **extra)

    def chat_tokens(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> list[int]:
        """:meth:`apply_chat_template` + :meth:`chat_text_tokens`."""
        return self.chat_text_tokens(self.apply_chat_template(messages, add_generation_prompt, **extra))

    def chat_text_tokens(self, text: str) -> list[int]:
        """Rendered chat text → tokens (parse_special) with exactly one leading BOS when the
        model adds BOS (a template may emit one itself)."""
        toks = self.tokenize(text, add_special=True, parse_special=True)
        bos = self.bos
        if bos >= 0 and len(toks) >= 2 and toks[0] == bos and toks[1] == bos:
            toks = toks[1:]
        return toks
