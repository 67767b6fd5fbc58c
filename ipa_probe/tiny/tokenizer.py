"""An offline CLIP tokenizer built from the BPE vocabulary that ``open_clip`` ships.

Stable Diffusion's text encoders use OpenAI's CLIP byte-pair encoding (49,408 tokens). ``open_clip`` installs that
vocabulary as ``bpe_simple_vocab_16e6.txt.gz``; this module turns it into the ``vocab.json`` + ``merges.txt`` pair
that ``transformers.CLIPTokenizer`` reads, in CLIP's own order:

1. the 256 byte-level characters (``bytes_to_unicode``),
2. the same 256 characters with the end-of-word marker ``</w>``,
3. one token per merge (the first 48,894 merges of the file, the pair joined),
4. ``<|startoftext|>`` (id 49406) and ``<|endoftext|>`` (id 49407).

The files are written once into a cache folder named by the hash of the BPE file, so the result is deterministic and
a new ``open_clip`` vocabulary gets a new folder. Writers build the folder under a temporary name and rename it into
place, which is atomic: concurrent callers (test workers, notebooks) never see a half-written folder.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import CLIPTokenizer

__all__ = [
    "CLIP_MODEL_MAX_LENGTH",
    "CLIP_VOCAB_SIZE",
    "bytes_to_unicode",
    "cache_root",
    "clip_bpe_path",
    "clip_tokenizer",
    "clip_tokenizer_dir",
    "clip_vocab_and_merges",
]

logger = logging.getLogger(__name__)

CLIP_VOCAB_SIZE = 49408
"""Number of tokens in CLIP's vocabulary: 2 * 256 byte tokens, 48,894 merges, 2 special tokens."""
CLIP_MODEL_MAX_LENGTH = 77
"""CLIP's context length (bos + 75 tokens + eos)."""
_NUM_MERGES = CLIP_VOCAB_SIZE - 2 * 256 - 2  # 48894
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"
_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the other 68 bytes (controls, space, ...) map to ``chr(256 + n)`` in
    increasing byte order, so that a byte-level BPE never has to handle whitespace or control characters.

    Returns:
        dict from byte value (0..255) to a one-character string, in CLIP's order (printable bytes first).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def clip_bpe_path() -> Path:
    """Path of the CLIP BPE merges file installed with ``open_clip`` (``bpe_simple_vocab_16e6.txt.gz``)."""
    from open_clip.tokenizer import default_bpe

    path = Path(default_bpe())
    if not path.is_file():
        raise FileNotFoundError(
            f"expected open_clip's CLIP vocabulary at {path}, found nothing; reinstall it with "
            "`pip install --force-reinstall open_clip_torch`"
        )
    return path


def clip_vocab_and_merges(bpe_path: str | os.PathLike | None = None) -> tuple[dict[str, int], list[str]]:
    """CLIP's vocabulary and merge list, read from the gzipped BPE file.

    ``bpe_path``: the ``bpe_simple_vocab_16e6.txt.gz`` file (default :func:`clip_bpe_path`). ``vocab`` maps each of the
    49,408 tokens to its id (the order given in the module docstring); ``merges`` holds the 48,894 merges as ``"a b"``
    strings, highest priority first.
    """
    path = Path(bpe_path) if bpe_path is not None else clip_bpe_path()
    lines = gzip.open(path, "rt", encoding="utf-8").read().split("\n")
    # Line 0 is the "#version" header; CLIP keeps the next 48,894 merges.
    merges = lines[1 : 1 + _NUM_MERGES]
    if len(merges) != _NUM_MERGES or any(len(m.split(" ")) != 2 for m in merges):
        raise ValueError(f"expected {_NUM_MERGES} 'a b' merge lines in {path}; the file is not CLIP's BPE vocabulary")
    byte_chars = list(bytes_to_unicode().values())
    tokens = [*byte_chars, *(c + "</w>" for c in byte_chars), *(m.replace(" ", "") for m in merges), _BOS, _EOS]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != CLIP_VOCAB_SIZE:
        raise ValueError(f"expected {CLIP_VOCAB_SIZE} distinct tokens from {path}, got {len(vocab)}")
    return vocab, merges


def cache_root() -> Path:
    """Folder for ipa_probe's generated files: ``$IPA_PROBE_CACHE``, else ``$XDG_CACHE_HOME/ipa_probe``, else
    ``~/.cache/ipa_probe``."""
    if env := os.environ.get("IPA_PROBE_CACHE"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ipa_probe"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _FILES)


def clip_tokenizer_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A folder holding CLIP's ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json``, written if missing.

    Deterministic (same BPE file, same bytes) and safe to call from several processes at once: the folder is built
    under a temporary name beside its final name and renamed into place; a writer that loses the race discards its
    copy.

    The folder is ``<cache_dir>/clip-tokenizer-<sha256 of the BPE file, 16 hex digits>`` (``cache_dir`` default
    :func:`cache_root`).
    """
    bpe = clip_bpe_path()
    parent = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = parent / f"clip-tokenizer-{_file_digest(bpe)}"
    if _is_complete(final):
        return final
    parent.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab_and_merges(bpe)
    tmp = Path(tempfile.mkdtemp(prefix=".clip-tokenizer-", dir=parent))
    try:
        (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        (tmp / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        config = {
            "tokenizer_class": "CLIPTokenizer",
            "model_max_length": CLIP_MODEL_MAX_LENGTH,
            "bos_token": _BOS,
            "eos_token": _EOS,
            "unk_token": _EOS,
            "pad_token": _EOS,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        try:
            os.rename(tmp, final)
            logger.info("wrote the CLIP tokenizer files to %s", final)
        except OSError:
            # Another process renamed its copy first (the target exists and is not empty).
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def clip_tokenizer(cache_dir: str | os.PathLike | None = None, pad_token: str = _EOS) -> CLIPTokenizer:
    """OpenAI CLIP's tokenizer (49,408 tokens, ``model_max_length`` 77) as a ``transformers.CLIPTokenizer``,
    without network access.

    It tokenizes like ``open_clip.tokenizer.SimpleTokenizer`` (bos, BPE tokens, eos), which is what Stable Diffusion
    1.5 and SDXL use.

    ``cache_dir``: see :func:`clip_tokenizer_dir`; ``pad_token``: ``"<|endoftext|>"`` (id 49407) as in SD 1.5;
    SDXL's second tokenizer pads with ``"!"`` (id 0).

    Example:
        ```py
        >>> tok = clip_tokenizer()
        >>> tok("a photo of a cat").input_ids
        [49406, 320, 1125, 539, 320, 2368, 49407]
        ```
    """
    folder = clip_tokenizer_dir(cache_dir)
    return CLIPTokenizer.from_pretrained(
        folder, model_max_length=CLIP_MODEL_MAX_LENGTH, pad_token=pad_token, local_files_only=True
    )
