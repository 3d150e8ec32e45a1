"""spmd.checkpoint.stream: rank files are safetensors that safetensors itself reads back, and a memory-mapped
(nvme-offloaded) tensor is written a piece at a time with its pages handed back after each, so a save never
holds more of it than one piece; a synchronous save writes such a tensor from its file, uncopied."""

import importlib

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from spmd import checkpoint as ckpt
from spmd.checkpoint import stream
from tests.zero_offload import resident_bytes

save_module = importlib.import_module("spmd.checkpoint.save")  # the package's `save` is the function


def _mapped(path, n: int) -> torch.Tensor:
    with open(path, "wb") as f:
        f.truncate(n * 4)
    t = torch.from_file(str(path), shared=True, size=n, dtype=torch.float32)
    t.copy_(torch.arange(n, dtype=torch.float32))
    return t


def test_safetensors_reads_what_the_stream_writes(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(3, 5),
        "h": torch.randn(4, 2).to(torch.bfloat16),
        "i": torch.arange(7),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
        "rng": torch.get_rng_state(),
    }
    path = str(tmp_path / "x.safetensors")
    stream.save_file(tensors, path, metadata={"format": "pt"})
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_file_backed_tensor_is_written_a_piece_at_a_time(tmp_path, monkeypatch):
    n = 1 << 20  # 4 MiB of fp32 in a file
    big = _mapped(tmp_path / "state.bin", n)
    monkeypatch.setattr(stream, "PIECE_BYTES", 256 * 1024)
    seen = []
    release = stream.release_pages

    def sampled(tensors):
        seen.append(resident_bytes(tensors))
        release(tensors)

    monkeypatch.setattr(stream, "release_pages", sampled)
    release([big])
    assert resident_bytes([big]) == 0
    path = str(tmp_path / "x.safetensors")
    stream.save_file({"big": big, "small": torch.ones(3)}, path)
    assert len(seen) == n * 4 // (256 * 1024)  # one release per piece
    assert 0 < max(seen) <= 256 * 1024 and resident_bytes([big]) == 0
    assert torch.equal(load_file(path)["big"], torch.arange(n, dtype=torch.float32))


def test_a_save_writes_file_backed_state_from_its_file(tmp_path):
    big = _mapped(tmp_path / "state.bin", 1 << 16)
    plain = torch.ones(4)
    staged = save_module._host_copy({"big": big, "plain": plain})
    assert staged["big"] is big  # not cloned into host memory
    assert staged["plain"] is not plain and torch.equal(staged["plain"], plain)  # copied: training changes it
    ckpt.save(tmp_path / "ckpt", 1, {"big": big})
    assert resident_bytes([big]) == 0
    loaded = {"big": torch.zeros(1 << 16)}
    ckpt.load(tmp_path / "ckpt", loaded)
    assert torch.equal(loaded["big"], torch.arange(1 << 16, dtype=torch.float32))
