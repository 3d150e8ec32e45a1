"""Data: a corpus becomes one flat token stream; the loader cuts deterministic batches out of it.

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

Batches. Step k's global batch is B windows of T+1 tokens whose start offsets are drawn by
`numpy.random.default_rng([seed, k])` - a function of (seed, k) alone, whatever the mesh. Row i is
`stream[s_i : s_i + T + 1]`; tokens are its first T ids, targets the last T. With R data-parallel ranks
and K accumulation micro-batches, data-parallel rank r owns rows [r*B/R, (r+1)*B/R) and micro-batch j of
rank r is rows r*B/R + j*B/(R*K) ... r*B/R + (j+1)*B/(R*K) - 1, i.e. the rank's slice cut in K
consecutive pieces. Ranks that differ only in tp/pp coordinates have the same data-parallel rank and so
identical batches; so do ranks that differ only in cp, and `model_inputs` then gives each its zigzag share
of the sequence with the tokens' positions. The loader's position (`state_dict()`) is the next step number.
"""

from __future__ import annotations

import fcntl
import glob as globlib
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

import spmd

from .corpora import STRUCTURED, dataset_documents, documents, saved_dataset
from .tokenizer import ByteTokenizer, load_tokenizer

_STDLIB_SKIP = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def cache_dir() -> Path:
    return Path(os.environ.get("SPMD_CACHE_DIR") or Path.home() / ".cache" / "spmd")


# ------------------------------------------------------------------------------------------------ corpora
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


# ------------------------------------------------------------------------------------------------ loader
class DataLoader:
    """This data-parallel rank's micro-batches, step by step (see the module docstring for the order).

    `next()` returns the K = grad_accum micro-batches of the next step, each (tokens, targets) of shape
    [batch_size / (dp_size * K), seq_len], int64 on `device`.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        batch_size: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        grad_accum: int = 1,
        seed: int = 0,
        vocab_size: int | None = None,
        device="cpu",
        fingerprint: str = "",
    ):
        if batch_size % (dp_size * grad_accum):
            raise ValueError(f"batch size {batch_size} must divide by dp_size*grad_accum = {dp_size * grad_accum}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
        if len(tokens) < seq_len + 2:
            raise ValueError(
                f"the corpus has {len(tokens)} tokens, fewer than one sequence of {seq_len + 1}; "
                f"use more data or a shorter --seq-len"
            )
        self.tokens, self.B, self.T = tokens, batch_size, seq_len
        self.rank, self.R, self.K = dp_rank, dp_size, grad_accum
        self.seed, self.vocab_size, self.device = seed, vocab_size, device
        self.fingerprint = fingerprint
        self.step = 0

    def starts(self, step: int) -> np.ndarray:
        """Start offsets of the B rows of the global batch at `step`."""
        rng = np.random.default_rng([self.seed, step])
        return rng.integers(0, len(self.tokens) - self.T - 1, size=self.B, endpoint=True)

    def rows(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) of the global batch at `step` as (tokens, targets)."""
        starts = self.starts(step)[lo:hi]
        idx = starts[:, None] + np.arange(self.T + 1)[None, :]
        window = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))
        if self.vocab_size is not None and window.numel():
            top = int(window.max())
            if top >= self.vocab_size:
                raise ValueError(
                    f"the data holds token id {top} but the model's vocabulary has {self.vocab_size} "
                    f"entries; tokenise with a tokenizer that fits the model (or a model whose "
                    f"vocab_size covers it)"
                )
        return window[:, :-1].to(self.device), window[:, 1:].to(self.device)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole [B, T] batch of `step` (for single-process references)."""
        return self.rows(step, 0, self.B)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        per_rank, per_micro = self.B // self.R, self.B // (self.R * self.K)
        base = self.rank * per_rank
        x, y = self.rows(step, base, base + per_rank)
        return [(x[j * per_micro : (j + 1) * per_micro], y[j * per_micro : (j + 1) * per_micro]) for j in range(self.K)]

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = self.micro_batches(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "fingerprint": self.fingerprint, "tokens": int(len(self.tokens))}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"the checkpoint's data seed is {state['seed']} but --seed is {self.seed}; "
                f"resume with --seed {state['seed']} to continue the same data order"
            )
        if state.get("fingerprint") and self.fingerprint and state["fingerprint"] != self.fingerprint:
            print(
                f"warning: the corpus differs from the one the checkpoint was trained on "
                f"({state['fingerprint']} vs {self.fingerprint}); continuing at step {state['step']} "
                f"on the new data",
                file=sys.stderr,
            )
        self.step = int(state["step"])


def build_loader(cfg, dp_rank: int, dp_size: int, vocab_size: int, device="cpu") -> tuple[DataLoader, object]:
    """(loader, tokenizer) for a TrainConfig."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"--tokenizer {cfg.tokenizer} has {tokenizer.vocab_size} tokens but the model's "
            f"vocabulary has {vocab_size}; use a model preset with a larger vocab_size (for "
            f"--model hf:DIR, vocab_size in DIR/config.json), or a --tokenizer with fewer tokens"
        )
    tokens, fingerprint = token_stream(cfg.data, tokenizer, cfg.data_field)
    loader = DataLoader(
        tokens,
        cfg.batch_size,
        cfg.seq_len,
        dp_rank,
        dp_size,
        cfg.grad_accum,
        cfg.seed,
        vocab_size=vocab_size,
        device=device,
        fingerprint=fingerprint,
    )
    return loader, tokenizer


__all__ = [
    "ByteTokenizer",
    "DataLoader",
    "build_loader",
    "token_stream",
    "stdlib_files",
    "text_files",
    "cache_dir",
    "load_tokenizer",
]


def model_inputs(tokens: torch.Tensor, targets: torch.Tensor, mesh) -> tuple:
    """The model's arguments for one micro-batch: (tokens, targets), or under context parallelism this cp
    rank's zigzag share of them and of their positions, which RoPE rotates by (spmd.cp_slice)."""
    if mesh is None or "cp" not in mesh.mesh_dim_names or mesh.size(mesh.mesh_dim_names.index("cp")) == 1:
        return tokens, targets
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return tuple(spmd.cp_slice(t, mesh) for t in (tokens, targets, positions))
