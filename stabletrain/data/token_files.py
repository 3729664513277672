"""Token files for ``data=tokens``: ``train.bin`` + ``val.bin`` + ``meta.json`` in one folder.

Each ``.bin`` is nanoGPT's format, a flat array of token ids with no header: documents one
after another, each ended by the tokenizer's end-of-text token. ``meta.json`` says what the
arrays hold (tokenizer, vocabulary, dtype, token counts, sources), so a reader needs no guess;
bins without it are read as nanoGPT's GPT-2 files (uint16, vocabulary 50257). Reading refuses,
in one line, a bin that is empty or not whole tokens, a meta.json without a usable dtype or
vocab_size, and ids at or beyond the vocabulary (files over 2 GiB are sampled: ``_max_id``).

Writing streams the documents to ``*.tmp`` files and renames them into place only when they
are complete, ``meta.json`` last: an interrupted run leaves ``.tmp`` files, never a set of
bins that looks finished.
"""

from __future__ import annotations

import codecs
import json
import math
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from stabletrain.config import ConfigError
from stabletrain.data.tokenizer import GPT2_VOCAB, doc_encoder

META = "meta.json"
LEGACY_META = {"vocab_size": GPT2_VOCAB, "dtype": "uint16"}  # nanoGPT's OpenWebText bins
BATCH_DOCS = 1024  # documents per tokenizer call (gpt2 encodes a batch on several threads)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding ids ``0 .. vocab_size - 1`` (uint16 up to 65536)."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


# --- reading ---------------------------------------------------------------------------

TOKEN_DTYPES = ("uint8", "uint16", "uint32")  # ids are never negative
SCAN_CHUNK = 16 * 2**20  # tokens per numpy max() when looking for ids beyond the vocabulary
SCAN_BYTES = 2 * 2**30  # read whole up to this size; larger files are sampled (see _max_id)


def _looks_like_text(path: Path) -> bool:
    """Whether the file starts as UTF-8 text (a .txt given where a train.bin belongs); token ids
    stored as uint16 hold zero bytes within the first kilobyte as a rule."""
    with open(path, "rb") as f:
        head = f.read(1024)
    try:  # not final: the kilobyte may end inside a character
        return b"\0" not in head and bool(codecs.getincrementaldecoder("utf-8")().decode(head, final=False).strip())
    except UnicodeDecodeError:
        return False


def load_token_files(path: str | Path) -> tuple[np.ndarray, np.ndarray, int]:
    """``(train, val, vocab_size)``: ``path`` and ``val.bin`` beside it, memory-mapped.

    Each file must hold whole tokens of the meta's dtype and only ids below its vocabulary;
    any problem is a one-line ConfigError naming the file or the meta.json key.
    """
    path = Path(path)
    if path.name in ("val.bin", META):
        raise ConfigError(f"data.path={path} is the {'validation file' if path.name == 'val.bin' else 'meta file'}; "
                          f"point it at the training file beside it: data.path={path.with_name('train.bin')}")
    if not path.is_file():
        raise ConfigError(f"data.path={path} is not a file: point data=tokens at a train.bin "
                          "(scripts/prepare_tokens.py writes one)")
    if path.suffix != ".bin" and _looks_like_text(path):
        raise ConfigError(f"data.path={path} is text, and data=tokens reads token files: write them with "
                          f"python scripts/prepare_tokens.py --files {path} --out DIR, then data.path=DIR/train.bin")
    val = path.with_name("val.bin")
    if not val.is_file():
        raise ConfigError(f"{val} is missing: data=tokens expects val.bin beside data.path")
    meta_file = path.with_name(META)
    meta = read_meta(meta_file) if meta_file.is_file() else LEGACY_META
    dtype, vocab = np.dtype(meta["dtype"]), meta["vocab_size"]
    if meta_file.is_file():
        dtype_from, vocab_from = f"the dtype {meta_file} gives", f"vocab_size {vocab} of {meta_file}"
    else:
        dtype_from = f"read as nanoGPT's uint16 for want of a {META}"
        vocab_from = f"{vocab}, the vocabulary assumed for bins without a {META} (nanoGPT's GPT-2 files)"
    arrays = {}
    for split, f in (("train", path), ("val", val)):
        arrays[split] = _token_array(f, dtype, dtype_from)
        want = meta.get(f"{split}_tokens")
        if want is not None and len(arrays[split]) != want:
            raise ConfigError(f"{f} holds {len(arrays[split])} tokens but {meta_file} says {want}: "
                              "they come from different runs; run scripts/prepare_tokens.py again")
        top = _max_id(arrays[split])
        if top >= vocab:  # the embedding would index out of range partway through a run
            raise ConfigError(f"{f} holds token id {top} >= {vocab_from}: the ids come from another tokenizer; "
                              f"give {meta_file} its vocab_size (> {top}) and dtype, with model.vocab_size at "
                              "least that, or re-tokenize with scripts/prepare_tokens.py")
    return arrays["train"], arrays["val"], vocab


def read_meta(meta_file: Path) -> dict:
    """``meta.json`` as a dict whose ``dtype`` and ``vocab_size`` are usable, else a one-line ConfigError."""
    fix = "fix it, or run scripts/prepare_tokens.py again to rewrite it"
    try:
        meta = json.loads(meta_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{meta_file} is not valid JSON ({_first_line(e)}): {fix}") from e
    if not isinstance(meta, dict):
        raise ConfigError(f"{meta_file} holds a JSON {type(meta).__name__}, not an object with dtype and "
                          f"vocab_size: {fix}")
    if "dtype" not in meta:
        raise ConfigError(f"{meta_file} lacks the key 'dtype' (one of {', '.join(TOKEN_DTYPES)}): {fix}")
    if meta["dtype"] not in TOKEN_DTYPES:
        raise ConfigError(f"{meta_file}: dtype={meta['dtype']!r} is not supported; token files hold "
                          f"{', '.join(TOKEN_DTYPES)}: {fix}")
    if "vocab_size" not in meta:
        raise ConfigError(f"{meta_file} lacks the key 'vocab_size' (the tokenizer's vocabulary): {fix}")
    for key in ("vocab_size", "train_tokens", "val_tokens"):
        v = meta.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{meta_file}: {key}={v!r} must be a positive integer: {fix}")
    return meta


def _token_array(f: Path, dtype: np.dtype, dtype_from: str) -> np.ndarray:
    size = f.stat().st_size
    if size == 0:
        raise ConfigError(f"{f} is empty (0 bytes): run scripts/prepare_tokens.py again")
    if size % dtype.itemsize:
        raise ConfigError(f"{f} is {size} bytes, not a whole number of {dtype.name} tokens "
                          f"({dtype.itemsize} bytes each, {dtype_from}): it is truncated or holds another "
                          "dtype; run scripts/prepare_tokens.py again")
    return np.memmap(f, dtype=dtype, mode="r")


def _max_id(arr: np.ndarray) -> int:
    """The largest id in ``arr``, read in chunks of SCAN_CHUNK tokens.

    An array of up to SCAN_BYTES is read whole. A larger one (OpenWebText's train.bin is 17 GB)
    would cost a full read from disk on every start, so only SCAN_BYTES of it is read: evenly
    spaced chunks, the first and the last included. Bins from another tokenizer hold large ids
    throughout, which that finds.
    """
    starts = np.arange(0, len(arr), SCAN_CHUNK)
    fit = SCAN_BYTES // (SCAN_CHUNK * arr.dtype.itemsize)
    if len(starts) > fit:
        starts = starts[np.linspace(0, len(starts) - 1, fit).round().astype(int)]
    return max(int(arr[s:s + SCAN_CHUNK].max()) for s in starts)


# --- inputs ----------------------------------------------------------------------------


def text_files(paths: Iterable[str | Path]) -> list[Path]:
    """Files named, and every file under folders named (sorted, hidden ones skipped)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file()
                          and not any(part.startswith(".") for part in f.relative_to(p).parts))
        elif p.is_file():
            out.append(p)
        else:
            raise ConfigError(f"--files {p}: no such file or folder")
    if not out:
        raise ConfigError("--files names no files")
    return out


def _utf8_contents(paths: list[Path], skipped: list[str]) -> Iterator[bytes]:
    """Each file's bytes, unchanged; files that are not UTF-8 text (``.pyc``, images) go to ``skipped``."""
    for p in paths:
        data = p.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(str(p))
            continue
        yield data


def offline_if_hub_unreachable() -> str | None:
    """Set ``HF_HUB_OFFLINE=1`` when the Hub cannot be reached, and say so.

    Without network, ``datasets`` retries every request for about half a minute before it
    fails, even for a data set it has cached; offline it reads the cache at once. One connection
    attempt decides. Must run before ``datasets`` is first imported, which reads the variable
    then; a variable already set (either one) is left alone and nothing is tried.
    """
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(k) is not None for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None  # the way out is the proxy, which a direct connection does not take
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), timeout=5).close()
        return None
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = "1"
        return f"note: {url.hostname} cannot be reached: reading the Hugging Face cache only (HF_HUB_OFFLINE=1)"


def hf_dataset(name: str | None = None, config: str | None = None, split: str = "train",
               disk: str | None = None, text_field: str = "text", revision: str | None = None):
    """One split of a Hugging Face data set, by hub name (cached or downloaded) or ``save_to_disk`` folder."""
    import sys

    if disk is None and (note := offline_if_hub_unreachable()):
        print(note, file=sys.stderr)
    import datasets

    if disk is not None:
        try:
            ds = datasets.load_from_disk(disk)
        except Exception as e:  # a missing folder or one not written by save_to_disk
            raise ConfigError(f"--hf-disk {disk}: cannot load it ({_first_line(e)}); "
                              "expected a folder written by Dataset.save_to_disk") from e
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ConfigError(f"--hf-disk {disk} has splits {list(ds)}, not {split!r}: pass --split/--val-split")
            ds = ds[split]
    else:
        try:
            ds = datasets.load_dataset(name, config, split=split, revision=revision)
        except Exception as e:  # offline: ConnectionError (an OSError); also a wrong name, config or split
            label = f"{name}" + (f" {config}" if config else "")
            fix = ("it needs network once to fill the HF cache, or a local copy: where there is network run "
                   "datasets.load_dataset(...).save_to_disk(DIR), copy DIR here and pass --hf-disk DIR"
                   if isinstance(e, OSError) else "check --hf, --hf-config, --split and --hf-revision")
            raise ConfigError(f"cannot load the Hugging Face data set '{label}' split {split!r} "
                              f"({_first_line(e)}): {fix}") from e
    if text_field not in ds.column_names:
        raise ConfigError(f"--text-field {text_field!r} is not a column of the data set; columns: {ds.column_names}")
    return ds


def hf_texts(ds, text_field: str = "text") -> Iterator[str]:
    for batch in ds.iter(batch_size=BATCH_DOCS):
        yield from batch[text_field]


def _first_line(e: Exception) -> str:
    msg = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


# --- writing ---------------------------------------------------------------------------


def _batches(docs: Iterable, n: int) -> Iterator[list]:
    batch = []
    for d in docs:
        batch.append(d)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _encoded(batch: list, enc, dtype: np.dtype, eot: bool) -> list[np.ndarray]:
    ids = [a.astype(dtype) for a in enc.encode(batch)]
    end = np.array([enc.eot], dtype=dtype)
    return [np.concatenate([a, end]) for a in ids] if eot else ids


def _append(f, arrays: list[np.ndarray]) -> int:
    if arrays:
        f.write(np.concatenate(arrays).tobytes())
    return sum(len(a) for a in arrays)


VAL_WINDOWS = 100  # windows' worth of text val.bin gets at least, up to a tenth of the text


def prepare_tokens(out_dir: str | Path, docs: Iterable, *, val_docs: Iterable | None = None,
                   tokenizer: str = "byte", val_fraction: float = 0.0005, block_size: int = 1024,
                   eot: bool = True, seed: int = 0, sources: list | None = None, extra: dict | None = None,
                   total: int | None = None, progress: bool = False) -> dict:
    """Write ``train.bin``, ``val.bin`` and ``meta.json`` into ``out_dir``; returns the meta.

    ``docs`` are ``str`` or ``bytes`` documents. val.bin holds ``val_docs`` when given (a data
    set's own split); else each document goes there with probability ``val_fraction`` (seeded;
    nanoGPT's OpenWebText split is a random 0.0005 of the documents too). ``eot=False``
    concatenates documents as they are (WikiText's rows are the lines of one text), so they are
    no units to draw from: val.bin is then the last ``val_fraction`` of the stream. Without
    ``val_docs``, val.bin gets at least :data:`VAL_WINDOWS` windows of ``block_size`` tokens or a
    tenth of the text, whichever is less; always at least ``block_size + 2`` (what
    ``data=tokens`` needs for one window); topped up from the end of train. ``extra`` is added
    to meta.json as it is once the documents have been read.
    """
    from tqdm import tqdm

    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction={val_fraction} must be in [0, 1)")
    enc = doc_encoder(tokenizer)
    dtype = token_dtype(enc.vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = {"train": out / "train.bin", "val": out / "val.bin"}
    tmp = {k: p.with_name(p.name + ".tmp") for k, p in final.items()}
    min_tokens = block_size + 2
    draw = val_docs is None and eot
    rng = np.random.default_rng(seed)
    n = {"train": 0, "val": 0}
    n_docs = {"train": 0, "val": 0}
    try:
        with open(tmp["train"], "wb") as ft, open(tmp["val"], "wb") as fv, \
                tqdm(total=total, unit="doc", desc="tokenizing", disable=not progress) as bar:
            for batch in _batches(docs, BATCH_DOCS):
                ids = _encoded(batch, enc, dtype, eot)
                to_val = rng.random(len(ids)) < val_fraction if draw else np.zeros(len(ids), bool)
                n["train"] += _append(ft, [a for a, v in zip(ids, to_val) if not v])
                n["val"] += _append(fv, [a for a, v in zip(ids, to_val) if v])
                n_docs["val"] += int(to_val.sum())
                n_docs["train"] += len(ids) - int(to_val.sum())
                bar.update(len(batch))
            for batch in _batches([] if val_docs is None else val_docs, BATCH_DOCS):
                n["val"] += _append(fv, _encoded(batch, enc, dtype, eot))
                n_docs["val"] += len(batch)
                bar.update(len(batch))
            bar.total = bar.n  # ``total`` counted files that turned out not to be text
        want, stream = min_tokens, n["train"] + n["val"]
        if val_docs is None and not eot:
            want = max(want, math.ceil(val_fraction * stream))
        if val_docs is None:
            # a small text: val gets up to a tenth of it, as far as VAL_WINDOWS windows, so that
            # val/loss is not the score of one window (0.0005 of a 400k-token book is 200 tokens)
            want = max(want, min(math.ceil(0.1 * stream), VAL_WINDOWS * block_size))
        move = min(max(0, want - n["val"]), n["train"])
        if move:  # the end of train tops val up
            n["train"] -= move
            tail = np.fromfile(tmp["train"], dtype=dtype, offset=n["train"] * dtype.itemsize)
            with open(tmp["val"], "ab") as fv:
                fv.write(tail.tobytes())
            os.truncate(tmp["train"], n["train"] * dtype.itemsize)
            n["val"] += move
        skipped = (extra or {}).get("skipped_files") or []
        if not n_docs["train"] + n_docs["val"] and skipped:
            raise ConfigError(f"no text to tokenize: all {len(skipped)} file(s) were skipped as not UTF-8 text "
                              f"(e.g. {skipped[0]}); give text files")
        for split in ("train", "val"):
            if n[split] < min_tokens:
                raise ConfigError(f"{split} would hold {n[split]} tokens, fewer than {min_tokens} "
                                  f"(--block-size {block_size} + 2): give more text or a smaller --block-size")
        meta = {"tokenizer": enc.name, "vocab_size": enc.vocab_size, "dtype": dtype.name,
                "eot": enc.eot if eot else None, "train_tokens": n["train"], "val_tokens": n["val"],
                "train_documents": n_docs["train"], "val_documents": n_docs["val"],
                "val_tail_tokens": move, "val_fraction": None if val_docs is not None else val_fraction,
                "seed": seed, "block_size": block_size, "sources": sources or [], **(extra or {})}
        # Drop the old meta.json first: bins renamed beside it would otherwise look like its run's.
        (out / META).unlink(missing_ok=True)
        for split in ("train", "val"):
            os.replace(tmp[split], final[split])
        meta_tmp = out / (META + ".tmp")
        meta_tmp.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(meta_tmp, out / META)
        return meta
    finally:
        for p in list(tmp.values()) + [out / (META + ".tmp")]:
            p.unlink(missing_ok=True)


def prepare_from_sources(out_dir: str | Path, *, files: list[str] | None = None, hf: str | None = None,
                         hf_config: str | None = None, hf_disk: str | None = None, hf_revision: str | None = None,
                         split: str = "train", val_split: str | None = None, text_field: str = "text",
                         **kw) -> dict:
    """:func:`prepare_tokens` from local text files/folders (each file one document) or a Hugging Face
    data set (each row's ``text_field`` one document), which ``scripts/prepare_tokens.py`` names."""
    if sum(x is not None for x in (files, hf, hf_disk)) != 1:
        raise ConfigError("give exactly one input: --files, --hf or --hf-disk")
    if files is not None:
        if val_split is not None:
            raise ConfigError("--val-split applies to --hf/--hf-disk; local files split by --val-fraction")
        paths, skipped = text_files(files), []
        # skipped fills while the documents are read, before meta.json is written: it lands there
        return prepare_tokens(out_dir, _utf8_contents(paths, skipped), total=len(paths),
                              sources=[str(Path(f).resolve()) for f in files], extra={"skipped_files": skipped},
                              **kw)
    source = ({"hf": hf, "config": hf_config, "revision": hf_revision} if hf is not None
              else {"hf_disk": str(Path(hf_disk).resolve())})
    train = hf_dataset(hf, hf_config, split, hf_disk, text_field, hf_revision)
    val = None if val_split is None else hf_dataset(hf, hf_config, val_split, hf_disk, text_field, hf_revision)
    return prepare_tokens(out_dir, hf_texts(train, text_field),
                          val_docs=None if val is None else hf_texts(val, text_field),
                          total=len(train) + (0 if val is None else len(val)),
                          sources=[{**source, "split": split, "val_split": val_split, "text_field": text_field}],
                          **kw)
