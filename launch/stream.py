"""The token stream: a corpus (`--data`) becomes one flat array of token ids, built once and cached.

Corpora (`--data`):
- `stdlib`: the `.py` files of this Python's standard library (`sysconfig.get_paths()["stdlib"]`), sorted by
  path, without site-packages and without the standard library's own test suites (which are half its size
  and mostly repetitive). Real text, present on every machine, no download.
- a text file, a directory (every file under it) or a glob (`data/**/*.txt`), sorted by path. Each file is
  a document, except `*.jsonl` and `*.parquet` files, whose records are (the `--data-field` field, `text` by
  default; `launch/corpora.py`).
- a directory written by `datasets.save_to_disk`: its rows, in order, are the documents.
- `FILE.bin`: pre-tokenised ids, nanoGPT style (a raw array, no header). Its dtype comes from a sidecar
  `FILE.bin.json` holding `{"dtype": "uint16"}` (or `"uint32"`) when there is one; otherwise uint16 when
  the tokenizer's vocabulary fits in 16 bits, else uint32.

Documents are encoded and each is followed by the tokenizer's eos id. The stream of a text corpus is cached
as `<cache>/tokens/<sha256 of tokenizer + file names + contents (+ the field of records)>.bin` (+ `.json`),
where `<cache>` is $SPMD_CACHE_DIR or ~/.cache/spmd, and memory-mapped; processes on one machine share one
copy, and a file lock makes one of them build it while the others wait.
"""

from __future__ import annotations

import fcntl
import glob as globlib
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from .corpora import STRUCTURED, dataset_documents, documents, saved_dataset

_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def cache_dir() -> Path:
    return Path(os.environ.get("SPMD_CACHE_DIR") or Path.home() / ".cache" / "spmd")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP and not d.startswith("."))
        files += [Path(here) / n for n in sorted(names) if n.endswith(".py")]
    return sorted(files)


def text_files(spec: str) -> list[Path]:
    """A file, a directory (all files under it) or a glob pattern, sorted."""
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
    else:
        files = [Path(p) for p in globlib.glob(str(path), recursive=True) if Path(p).is_file()]
    if not files:
        raise ValueError(
            f"--data {spec!r} matches no files; pass 'stdlib', a text/.jsonl/.parquet file, a "
            f"directory, a glob like 'corpus/**/*.txt', or a pre-tokenised FILE.bin"
        )
    return sorted(files)


def _bin_dtype(path: Path, tokenizer) -> np.dtype:
    sidecar = Path(str(path) + ".json")
    if sidecar.is_file():
        name = json.loads(sidecar.read_text()).get("dtype")
        if name not in ("uint16", "uint32"):
            raise ValueError(f"{sidecar}: dtype must be 'uint16' or 'uint32', got {name!r}")
        return np.dtype(name)
    return np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)


def _build_stream(docs, n_files: int, tokenizer, out: Path) -> None:
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    eos = np.asarray([tokenizer.eos_id if tokenizer.eos_id is not None else 0], dtype=dtype)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    n = n_docs = 0

    def flush(chunk):
        nonlocal n
        for ids in tokenizer.encode_batch(chunk):
            f.write(ids.astype(dtype).tobytes())
            f.write(eos.tobytes())
            n += len(ids) + 1

    try:
        with open(tmp, "wb") as f:
            chunk = []
            for doc in docs:
                chunk.append(doc)
                n_docs += 1
                if len(chunk) == 256:
                    flush(chunk)
                    chunk = []
            flush(chunk)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "dtype": np.dtype(dtype).name,
                "tokens": n,
                "files": n_files,
                "documents": n_docs,
                "tokenizer": tokenizer.identity,
            }
        )
    )
    os.replace(tmp, out)


def token_stream(data: str, tokenizer, field: str = "text") -> tuple[np.ndarray, str]:
    """(1-D token array, fingerprint) for a `--data` spec; `field` names the text of JSONL/Parquet/datasets
    records. Text corpora are tokenised once and cached."""
    if data.endswith(".bin"):
        path = Path(data).expanduser()
        if not path.is_file():
            raise ValueError(f"--data {data!r}: no such file; pass an existing pre-tokenised .bin file")
        dtype = _bin_dtype(path, tokenizer)
        if path.stat().st_size % dtype.itemsize:
            raise ValueError(
                f"{path} has {path.stat().st_size} bytes, not a whole number of {dtype.name} ids; "
                f"write a {path}.json sidecar with the right dtype"
            )
        tokens = np.memmap(path, dtype=dtype, mode="r")
        st = path.stat()
        return tokens, f"bin:{path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    dataset = None if data == "stdlib" else saved_dataset(data)
    if dataset is not None:
        files = sorted(p for p in dataset.rglob("*") if p.is_file())
        docs = dataset_documents(dataset, field)
    else:
        files = stdlib_files() if data == "stdlib" else text_files(data)
        docs = documents(files, field)
    h = hashlib.sha256(tokenizer.identity.encode())
    if dataset is not None or any(p.suffix in STRUCTURED for p in files):
        h.update(f"field={field}\0".encode())
    for p in files:
        h.update(str(p).encode() + b"\0")
        h.update(p.read_bytes())
    key = h.hexdigest()[:24]
    out = cache_dir() / "tokens" / f"{key}.bin"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process per machine builds; the rest wait, then reuse
            if not out.is_file():
                _build_stream(docs, len(files), tokenizer, out)
    dtype = np.dtype(json.loads(out.with_suffix(".json").read_text())["dtype"])
    return np.memmap(out, dtype=dtype, mode="r"), key
