"""launch.corpora: JSONL, Parquet and datasets.save_to_disk corpora give the token stream the same documents
give as plain text files, one document per file, each followed by eos."""

import json
import sys

import numpy as np
import pytest
import torch

from launch.config import TrainConfig
from launch.data import DataLoader, build_loader, token_stream
from launch.tokenizer import ByteTokenizer

DOCS = ["def f(x):\n    return x + 1\n", 'ünïcode and "quotes"\n', "", "the last one"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def _reference(tmp_path) -> np.ndarray:
    d = tmp_path / "text"
    d.mkdir()
    for i, doc in enumerate(DOCS):
        (d / f"{i:03d}.txt").write_text(doc)
    tokens, _ = token_stream(str(d), ByteTokenizer())
    expected = []
    for doc in DOCS:
        expected += list(doc.encode()) + [ByteTokenizer.eos_id]
    assert tokens.tolist() == expected
    return np.asarray(tokens)


def _jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)) + "\n")
    return path


def test_jsonl_parquet_and_datasets_match_plain_text(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    ref = _reference(tmp_path)
    tok = ByteTokenizer()
    inputs = {"jsonl": str(_jsonl(tmp_path / "docs.jsonl", DOCS))}
    (tmp_path / "shards").mkdir()  # a glob over two files: documents in file-name order
    _jsonl(tmp_path / "shards" / "a.jsonl", DOCS[:2])
    _jsonl(tmp_path / "shards" / "b.jsonl", DOCS[2:])
    inputs["jsonl glob"] = str(tmp_path / "shards" / "*.jsonl")
    table = pa.table({"id": list(range(len(DOCS))), "text": DOCS})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=3)
    inputs["parquet"] = str(tmp_path / "docs.parquet")
    ds = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS})
    ds.save_to_disk(str(tmp_path / "saved"))
    inputs["datasets"] = str(tmp_path / "saved")
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    inputs["datasets dict"] = str(tmp_path / "dict")
    for name, spec in inputs.items():
        tokens, key = token_stream(spec, tok)
        assert np.array_equal(np.asarray(tokens), ref), name
        again, key2 = token_stream(spec, tok)  # cached
        assert key2 == key and np.array_equal(np.asarray(again), ref), name
    test_split, _ = token_stream(str(tmp_path / "dict" / "test"), tok)
    assert test_split.tolist() == list(DOCS[0].encode()) + [tok.eos_id]


def test_data_field_and_the_batches_of_each_step(tmp_path):
    ref = DataLoader(_reference(tmp_path), 4, 8, seed=5)
    path = _jsonl(tmp_path / "content.jsonl", DOCS, field="content")
    cfg = TrainConfig(data=str(path), data_field="content", batch_size=4, seq_len=8, seed=5)
    loader, _ = build_loader(cfg, 0, 1, vocab_size=512)
    for step in (0, 3):
        assert torch.equal(loader.global_batch(step)[0], ref.global_batch(step)[0])
    with pytest.raises(ValueError, match=r"content.jsonl:1 has no field 'text' \(it has: id, content\).*--data-field"):
        token_stream(str(path), ByteTokenizer())


def test_bad_records_are_clear_errors(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: field 'text' is int, not text"):
        token_stream(str(bad), ByteTokenizer())
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not valid JSON"):
        token_stream(str(bad), ByteTokenizer())
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"no column 'text' \(it has: body\).*--data-field"):
        token_stream(str(tmp_path / "t.parquet"), ByteTokenizer())
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["validation"]}')
    with pytest.raises(ValueError, match=r"without a 'train' split.*dd/SPLIT \(splits: validation\)"):
        token_stream(str(tmp_path / "dd"), ByteTokenizer())
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ImportError, match=r"needs the `pyarrow` package: pip install 'spmd\[data\]'"):
        token_stream(str(tmp_path / "t.parquet"), ByteTokenizer())
