"""Documents out of corpus files: plain text, JSON Lines, Parquet and `datasets.save_to_disk` directories.

- any other file is one document (its bytes);
- `*.jsonl`: one JSON object per line (blank lines skipped), the document being its `field` (`--data-field`,
  default `text`), a string;
- `*.parquet`: one row per document, the string column `field`;
- a directory written by `datasets.Dataset.save_to_disk` (it holds `state.json` and `dataset_info.json`):
  one row per document, column `field`, in the dataset's order. A `DatasetDict` directory
  (`dataset_dict.json`) is read from its `train` split; `--data DIR/SPLIT` picks another.

Parquet needs `pyarrow` and saved datasets need `datasets`: `pip install 'spmd[data]'`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

STRUCTURED = (".jsonl", ".parquet")
_ROWS = 1024  # rows read at a time from Parquet files and datasets


def _need(module: str, what: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ImportError(
            f"{what} needs the `{module.split('.')[0]}` package: pip install 'spmd[data]' "
            f"(or pip install {module.split('.')[0]})"
        ) from None


def saved_dataset(path: str | Path) -> Path | None:
    """The `Dataset.save_to_disk` directory `path` names (a DatasetDict's `train` split), or None."""
    path = Path(path).expanduser()
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(
                f"--data {str(path)!r} is a datasets.DatasetDict without a 'train' split; pass one "
                f"of its splits as --data {path}/SPLIT (splits: {', '.join(splits) or 'none'})"
            )
        path = path / "train"
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        return path
    return None


def _check(value, field: str, where: str, keys) -> str:
    if value is None and field not in keys:
        raise ValueError(
            f"{where} has no field {field!r} (it has: {', '.join(map(str, keys)) or 'none'}); "
            f"name the text field with --data-field"
        )
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: field {field!r} is {type(value).__name__}, not text; name the text field with --data-field"
        )
    return value


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{n} is not valid JSON ({e}); a .jsonl file holds one JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{n} is a JSON {type(record).__name__}, not an object with a {field!r} field")
            yield _check(record.get(field), field, f"{path}:{n}", record.keys())


def _column(names: list[str], field: str, where: str) -> None:
    if field not in names:
        raise ValueError(
            f"{where} has no column {field!r} (it has: {', '.join(names)}); name the text column with --data-field"
        )


def _parquet(path: Path, field: str) -> Iterator[str]:
    pq = _need("pyarrow.parquet", f"--data {path} (Parquet)")
    file = pq.ParquetFile(path)
    _column(file.schema_arrow.names, field, str(path))
    row = 0
    for batch in file.iter_batches(batch_size=_ROWS, columns=[field]):
        for value in batch.column(0).to_pylist():
            yield _check(value, field, f"{path} row {row}", [field])
            row += 1


def dataset_documents(path: Path, field: str) -> Iterator[str]:
    datasets = _need("datasets", f"--data {path} (a datasets.save_to_disk directory)")
    ds = datasets.load_from_disk(str(path))
    _column(ds.column_names, field, str(path))
    for batch in ds.select_columns([field]).iter(batch_size=_ROWS):
        for value in batch[field]:
            yield _check(value, field, str(path), [field])


def documents(files: list[Path], field: str = "text") -> Iterator[bytes | str]:
    """The documents of `files` in order, each read as its suffix says (module docstring)."""
    for path in files:
        if path.suffix == ".jsonl":
            yield from _jsonl(path, field)
        elif path.suffix == ".parquet":
            yield from _parquet(path, field)
        else:
            yield path.read_bytes()
