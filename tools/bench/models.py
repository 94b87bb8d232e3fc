"""Which model file each scenario runs, for a given ``--model``.

With ``--model tiny`` one model cannot serve every scenario: the default tiny model decodes
~9 000 tok/s (it measures our per-token overhead, not llama.cpp), a slower one is needed to
keep the cores busy for the latency scenarios, and its KV cache is ~256 B per token, so a
state of hundreds of MiB would take minutes of quadratic prefill. So tiny mode uses:

* ``main``: the tiny model (decode overhead, slot scaling, connections, ggml passthrough);
* ``busy``: ``tiny-small`` (~0.6 ms per token) for META/INFO latency while decoding;
* ``state``: a generated *KV-heavy* model (64 layers, 4 full-size KV heads of 64 dims, a
  tiny FFN): 64 KiB of f16 KV per token — the KV geometry of a 70B-class model, at a
  fraction of its compute — so 256 MiB of state needs ~2 000 tokens, not 500 000;
* ``reload_target``: the same KV-heavy model (64 layers of tensors make the load
  measurable, unlike the 1 ms tiny loads);
* ``load_heavy``: ``tiny-large``, whose load takes about a second for the reasons a real
  model's does (a large vocabulary, weights repacked at load), for reload-stall with the
  server's default flags.

With a real model (``gemma-270m`` or a path) every role uses that model, and the reload
goes to a symlink of it under another name (a different ``model_path`` is a real T3 reload).
"""
from __future__ import annotations

import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.model_files import TinyModelParams, default_cache_dir, resolve_model, write_tiny_gguf

#: The bench's KV-heavy model (see the module docstring). f16 weights; ~40 MB.
KV_HEAVY = TinyModelParams(n_vocab=512, n_embd=256, n_layer=64, n_head=4, n_head_kv=4, n_ff=64, dtype="f16",
                           seed=6464, name="hydra-bench-kv")


@dataclass(frozen=True)
class ModelSet:
    spec: str
    tiny: bool
    main: str
    busy: str
    state: str
    reload_target: str
    # KV cache type for the state scenario (tiny: f32 doubles the bytes per token at the same
    # prefill cost, so 256 MiB is reached with half the tokens)
    state_cache_type: str | None
    state_tokens: tuple[int, ...]  # n_past steps of the state scenario (full run)
    state_tokens_quick: tuple[int, ...]


    @property
    def label(self) -> str:
        """The model as a table shows it: the spec, or a path's file name."""
        return Path(self.spec).name if os.sep in self.spec else self.spec

    def describe(self) -> dict:
        return asdict(self)


def ensure_generated(params: TinyModelParams) -> Path:
    """Write a generated model once into the shared model cache (name carries the params hash)."""
    d = default_cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    target = d / f"{params.name}-{params.dtype}-{params.digest()}.gguf"
    if not target.is_file():
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            write_tiny_gguf(tmp, params)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _alias_link(path: Path) -> Path:
    """A symlink to ``path`` under another name: same weights, different model_path."""
    d = default_cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    link = d / f"bench-reload-target-{path.stem}.gguf"
    if not (link.is_symlink() and link.resolve() == path.resolve()):
        tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(path.resolve())
        os.replace(tmp, link)
    return link


#: the model sets of generated tiny models (every other spec is one model file for every scenario)
TINY_SETS = ("tiny", "tiny-a")


def model_set(spec: str) -> ModelSet:
    if spec in TINY_SETS:
        kv = str(ensure_generated(KV_HEAVY))
        return ModelSet(spec=spec, tiny=True, main=str(resolve_model("tiny")), busy=str(resolve_model("tiny-small")),
                        state=kv, reload_target=kv, state_cache_type="f32",
                        state_tokens=(64, 256, 1024, 2048), state_tokens_quick=(32, 128))
    path = resolve_model(spec)
    return ModelSet(spec=spec, tiny=False, main=str(path), busy=str(path), state=str(path),
                    reload_target=str(_alias_link(path)), state_cache_type=None,
                    state_tokens=(512, 2048, 8192), state_tokens_quick=(128, 512))


def load_heavy(models: ModelSet, quick: bool) -> tuple[str, str]:
    """(a model whose load takes about a second, the same file under another name).

    Tiny mode: ``tiny-large`` (generated on first use, which takes a minute; quick runs use
    the KV-heavy model instead); a real model: itself.
    """
    path = Path(models.state if quick and models.tiny else resolve_model("tiny-large") if models.tiny
                else models.main)
    return str(path), str(_alias_link(path))
