"""launch.data / launch.tokenizer: corpora, the token cache, and the loader's mesh-independent batch order."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from launch.data import DataLoader, stdlib_files, text_files, token_stream
from launch.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_CACHE_DIR", str(tmp_path / "cache"))


def test_byte_tokenizer():
    tok = load_tokenizer("bytes")
    ids = tok.encode("héllo")
    assert ids.tolist() == list("héllo".encode()) and tok.decode(list(ids) + [tok.eos_id]) == "héllo"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)


def test_stdlib_corpus_is_sorted_and_skips_tests_and_site_packages():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files) and root / "os.py" in files
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in files)


def test_stdlib_stream_is_cached(tmp_path):
    tokens, key = token_stream("stdlib", ByteTokenizer())
    cached = list((tmp_path / "cache" / "tokens").glob("*.bin"))
    assert [p.stem for p in cached] == [key] and tokens.dtype == np.uint16
    assert len(tokens) > 1_000_000 and int(tokens.max()) == ByteTokenizer.eos_id
    again, key2 = token_stream("stdlib", ByteTokenizer())
    assert key2 == key and np.array_equal(np.asarray(again[:10000]), np.asarray(tokens[:10000]))


def test_text_files_glob_dir_and_cache_key(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("bee")
    (d / "sub" / "a.txt").write_text("ay")
    (d / ".hidden").write_text("x")
    assert text_files(str(d)) == [d / "b.txt", d / "sub" / "a.txt"]
    assert text_files(str(d / "**" / "a.txt")) == [d / "sub" / "a.txt"]
    tokens, key = token_stream(str(d), ByteTokenizer())
    assert tokens.tolist() == list(b"bee") + [257] + list(b"ay") + [257]
    (d / "b.txt").write_text("bed")  # new content, new cache entry
    tokens2, key2 = token_stream(str(d), ByteTokenizer())
    assert key2 != key and tokens2.tolist()[:3] == list(b"bed")
    with pytest.raises(ValueError, match="matches no files"):
        text_files(str(tmp_path / "*.nothing"))


def test_bin_files(tmp_path):
    ids = np.arange(1000, dtype=np.uint32) * 70  # ids above 65535 need uint32
    path = tmp_path / "train.bin"
    ids.tofile(path)
    (tmp_path / "train.bin.json").write_text(json.dumps({"dtype": "uint32"}))
    tokens, _ = token_stream(str(path), ByteTokenizer())
    assert tokens.dtype == np.uint32 and np.array_equal(tokens, ids)
    small = tmp_path / "small.bin"
    np.arange(10, dtype=np.uint16).tofile(small)  # no sidecar: uint16 because the vocabulary fits
    assert token_stream(str(small), ByteTokenizer())[0].tolist() == list(range(10))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a whole number of uint16"):
        token_stream(str(odd), ByteTokenizer())
    with pytest.raises(ValueError, match="no such file"):
        token_stream(str(tmp_path / "none.bin"), ByteTokenizer())
    loader = DataLoader(tokens, 2, 8, vocab_size=512)
    with pytest.raises(ValueError, match="token id .* but the model's vocabulary has 512"):
        loader.next()


def test_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        ["def f(x):\n    return x + 1\n"] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert isinstance(hf, HFTokenizer) and hf.eos_id == 0 and hf.vocab_size <= 300
    text = tmp_path / "a.py"
    text.write_text("def f(x):\n    return x + 1\n")
    tokens, _ = token_stream(str(text), hf)
    assert tokens[-1] == hf.eos_id and hf.decode(tokens[:-1]) == text.read_text()
    with pytest.raises(ValueError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing.json"))


def test_global_batch_independent_of_mesh_and_accumulation():
    tokens = np.arange(5000, dtype=np.uint16) % 300
    B, T = 8, 16
    ref = DataLoader(tokens, B, T, seed=3)
    x0, y0 = ref.global_batch(0)
    assert x0.shape == (B, T) and x0.dtype == torch.int64 and torch.equal(x0[:, 1:], y0[:, :-1])
    assert not torch.equal(x0, ref.global_batch(1)[0])
    assert torch.equal(x0, DataLoader(tokens, B, T, seed=3).global_batch(0)[0])  # deterministic
    assert not torch.equal(x0, DataLoader(tokens, B, T, seed=4).global_batch(0)[0])  # seeded
    for R, K in [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4), (4, 2), (8, 1)]:
        pieces = []
        for r in range(R):
            loader = DataLoader(tokens, B, T, dp_rank=r, dp_size=R, grad_accum=K, seed=3)
            for step in range(3):
                micro = loader.next()
                assert len(micro) == K and all(x.shape == (B // (R * K), T) for x, _ in micro)
                if step == 1:  # rank r's micro-batch j is the documented fixed slice of the global batch
                    pieces += [x for x, _ in micro]
                    for j, (x, _) in enumerate(micro):
                        lo = r * B // R + j * B // (R * K)
                        assert torch.equal(x, ref.rows(1, lo, lo + B // (R * K))[0])
        assert torch.equal(torch.cat(pieces), ref.global_batch(1)[0]), (R, K)


def test_loader_state_resumes_the_sequence():
    tokens = np.arange(3000, dtype=np.uint16)
    a = DataLoader(tokens, 4, 8, seed=1, fingerprint="k")
    for _ in range(5):
        a.next()
    b = DataLoader(tokens, 4, 8, seed=1, fingerprint="k")
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert torch.equal(a.next()[0][0], b.next()[0][0])
    with pytest.raises(ValueError, match="resume with --seed 1"):
        DataLoader(tokens, 4, 8, seed=2).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="fewer than one sequence"):
        DataLoader(tokens[:5], 4, 8)
