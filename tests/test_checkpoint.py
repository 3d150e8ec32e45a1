"""spmd.checkpoint: sharded safetensors checkpoints written on one mesh load exactly on another, saving is atomic
(a kill at any file of a save leaves the previous checkpoint), and checksums catch damaged files.

Distributed tests run 4 gloo CPU processes; values are compared exactly against the single-process tensors.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from spmd import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[1]


def _reference() -> dict[str, torch.Tensor]:
    """Global tensors; shapes chosen so Shard(0) over 4 ranks is uneven and Shard(1) over 4 leaves 1 column."""
    g = torch.Generator().manual_seed(0)
    return {
        "layers.0.w": torch.randn(10, 6, generator=g),
        "emb": torch.randn(8, 4, generator=g),
        "norm": torch.randn(6, generator=g),
        "lowp": torch.randn(4, 8, generator=g).to(torch.bfloat16),
    }


# placements per mesh: tensor name -> placements (one per mesh dim)
LAYOUTS = {
    ("fsdp",): {"layers.0.w": [Shard(0)], "emb": [Shard(1)], "norm": [Replicate()], "lowp": [Shard(1)]},
    ("fsdp", "tp"): {
        "layers.0.w": [Shard(0), Shard(1)],
        "emb": [Replicate(), Shard(0)],
        "norm": [Replicate(), Replicate()],
        "lowp": [Shard(0), Shard(0)],
    },
}
SHAPES = {("fsdp",): (4,), ("fsdp", "tp"): (2, 2)}


def _grads(ref):
    g = torch.Generator().manual_seed(1)
    return {k: torch.randn(v.shape, generator=g).to(v.dtype) for k, v in ref.items()}


def _single_process_adam():
    """One AdamW step on plain tensors: the expected parameters and optimizer state."""
    params = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in _reference().items()}
    opt = torch.optim.AdamW(params.values(), lr=0.1)
    for k, g in _grads(_reference()).items():
        params[k].grad = g
    opt.step()
    return params, opt


class _Model(torch.nn.Module):
    """Wraps a dict of parameters so model_state/optim_state see parameter names."""

    def __init__(self, params: dict):
        super().__init__()
        self.p = torch.nn.ParameterDict(
            {
                k.replace(".", "_"): torch.nn.Parameter(v.clone() if not isinstance(v, DTensor) else v)
                for k, v in params.items()
            }
        )

    def items(self):
        """(reference name, parameter) in the reference order."""
        return [(k, self.p[k.replace(".", "_")]) for k in _reference()]


def _distributed_state(mesh_names, zeros: bool):
    mesh = init_device_mesh("cpu", SHAPES[mesh_names], mesh_dim_names=mesh_names)
    ref = _reference()
    params = {
        k: distribute_tensor(torch.zeros_like(v) if zeros else v, mesh, LAYOUTS[mesh_names][k]) for k, v in ref.items()
    }
    model = _Model(params)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt, mesh


def _save_then_reshard(rank, world, root, src, dst):
    root = Path(root)
    src, dst = tuple(src), tuple(dst)
    model, opt, mesh = _distributed_state(src, zeros=False)
    for (k, v), (_, p) in zip(_grads(_reference()).items(), model.items()):
        p.grad = distribute_tensor(v, mesh, LAYOUTS[src][k])
    opt.step()
    torch.manual_seed(1234 + rank)
    saved = ckpt.save(
        root / "a",
        7,
        ckpt.model_state(model),
        ckpt.optim_state(model, opt),
        meta={"config": {"mesh": list(src)}, "data": {"step": 7}},
    )
    rng_after_save = torch.rand(3)

    # Load on the other mesh, into fresh (zero) DTensors and a fresh optimizer.
    model2, opt2, _ = _distributed_state(dst, zeros=True)
    meta = ckpt.load(root / "a", ckpt.model_state(model2), ckpt.optim_state(model2, opt2, init=True), rng=True)
    assert meta["step"] == 7 and meta["data"] == {"step": 7} and meta["world_size"] == 4
    assert torch.equal(torch.rand(3), rng_after_save), "RNG state was not restored"
    exp_params, exp_opt = _single_process_adam()
    for (k, exp), (_, p) in zip(exp_params.items(), model2.items()):
        assert isinstance(p, DTensor) and list(p.placements) == LAYOUTS[dst][k]
        assert torch.equal(p.full_tensor(), exp.detach()), k
        st, exp_st = opt2.state[p], exp_opt.state[exp]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key].full_tensor(), exp_st[key]), (k, key)
        assert float(st["step"]) == 1.0
    # The resharded optimizer keeps training exactly like the single-process one.
    for (_, v), (_, p) in zip(_grads(_reference()).items(), model2.items()):
        p.grad = distribute_tensor(v, p.device_mesh, p.placements)
    opt2.step()
    for q, exp in exp_params.items():
        exp.grad = _grads(_reference())[q]
    exp_opt.step()
    for (k, exp), (_, p) in zip(exp_params.items(), model2.items()):
        assert torch.equal(p.full_tensor(), exp.detach()), k
    ckpt.save(root / "b", 8, ckpt.model_state(model2), ckpt.optim_state(model2, opt2))

    if rank == 0:
        index = json.loads((saved / "index.json").read_text())
        files = {s["file"] for e in index["tensors"].values() for s in e["shards"]}
        # replicated tensors are written once, by the rank with coordinate 0 on the replicated dims
        assert len(index["tensors"]["model.p.norm"]["shards"]) == 1
        assert index["tensors"]["model.p.layers_0_w"]["shape"] == [10, 6]
        assert sorted(os.listdir(saved)) == sorted(
            ["index.json", "meta.json"] + [f"rank-{r:05d}.safetensors" for r in range(4)]
        )
        assert files <= set(os.listdir(saved))


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [(("fsdp",), ("fsdp", "tp")), (("fsdp", "tp"), ("fsdp",))])
def test_reshard_across_meshes_and_to_one_process(tmp_path, src, dst):
    run_distributed(_save_then_reshard, 4, str(tmp_path), list(src), list(dst), timeout_s=180)
    exp_params, exp_opt = _single_process_adam()
    # step 7 (one AdamW step) and step 8 (two), loaded into plain tensors in this single process
    model = _Model({k: torch.zeros_like(v) for k, v in _reference().items()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    meta = ckpt.load(tmp_path / "a", ckpt.model_state(model), ckpt.optim_state(model, opt, init=True))
    assert meta["config"] == {"mesh": list(src)}
    for (k, exp), (_, p) in zip(exp_params.items(), model.items()):
        assert torch.equal(p.detach(), exp.detach()), k
        assert torch.equal(opt.state[p]["exp_avg_sq"], exp_opt.state[exp]["exp_avg_sq"]), k
    ckpt.load(tmp_path / "b", ckpt.model_state(model), ckpt.optim_state(model, opt))
    for q, exp in exp_params.items():
        exp.grad = _grads(_reference())[q]
    exp_opt.step()
    for (k, exp), (_, p) in zip(exp_params.items(), model.items()):
        assert torch.equal(p.detach(), exp.detach()), k
        assert float(opt.state[p]["step"]) == 2.0


def test_single_process_roundtrip_and_pointer(tmp_path):
    ref = _reference()
    model = _Model(ref)
    model.register_buffer("count", torch.tensor([3, 4]))  # persistent buffers are saved too
    model.register_buffer("scratch", torch.ones(2), persistent=False)  # ... non-persistent ones are not
    assert ckpt.latest(tmp_path) is None
    d1 = ckpt.save(tmp_path, 1, ckpt.model_state(model), meta={"note": "one"})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    d2 = ckpt.save(tmp_path, 2, ckpt.model_state(model), meta={"note": "two"}, keep=1)
    assert ckpt.latest(tmp_path) == d2 and not d1.exists()  # keep=1 removed step-1
    assert (tmp_path / "latest").read_text().strip() == "step-2"
    assert sorted(ckpt.tensor_names(tmp_path)) == ["model.count"] + sorted(
        f"model.p.{k.replace('.', '_')}" for k in ref
    )
    fresh = _Model({k: torch.zeros_like(v) for k, v in ref.items()})
    fresh.register_buffer("count", torch.zeros(2, dtype=torch.long))
    assert ckpt.load(tmp_path, ckpt.model_state(fresh))["note"] == "two"
    for (k, v), (_, p) in zip(ref.items(), fresh.items()):
        assert p.dtype == v.dtype and torch.equal(p.detach(), v + 1), k
    assert fresh.count.tolist() == [3, 4]
    assert torch.equal(ckpt.read_full(d2, "model.p.emb"), ref["emb"] + 1)


def test_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ckpt.load(tmp_path, {})
    ckpt.save(tmp_path, 3, {"w": torch.ones(2, 3)})
    with pytest.raises(ValueError, match=r"global shape \[2, 3\] but the target is \[3, 2\]"):
        ckpt.load(tmp_path, {"w": torch.zeros(3, 2)})
    with pytest.raises(KeyError, match="missing.*model.v.*unexpected"):
        ckpt.load(tmp_path, {"v": torch.zeros(2)})
    ckpt.load(tmp_path, {"w": torch.zeros(2, 3), "v": torch.zeros(2)}, strict=False)
    with pytest.raises(TypeError, match="JSON-serialisable"):
        ckpt.save(tmp_path, 4, {"w": torch.ones(1)}, meta={"x": object()})
    with pytest.raises(TypeError, match="not a tensor"):
        ckpt.save(tmp_path, 4, {"w": 1.0})
    assert ckpt.latest(tmp_path).name == "step-3"  # failed saves left the pointer alone


_SAVE_THREE = textwrap.dedent("""
    import sys, torch
    import fault_injection
    from spmd import checkpoint as ckpt
    fault_injection.kill_after_files(setattr, int(sys.argv[2]))
    for step in (1, 2, 3):  # one process writes 3 files a save: its rank file, meta.json, index.json
        ckpt.save(sys.argv[1], step, {"w": torch.full((64, 32), float(step)), "b": torch.arange(5.0) * step},
                  meta={"n": step})
""")


@pytest.mark.parametrize("files", [7, 8, 9], ids=["after-rank-file", "after-meta", "after-index"])
def test_a_kill_at_each_point_of_a_save_leaves_the_previous_checkpoint(tmp_path, files):
    """fault_injection.kill_after_files(N) kills the saver right after its N-th file: 7, 8, 9 are the rank file,
    meta.json and index.json of the third save (the last one before the rename)."""
    paths = [str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run([sys.executable, "-c", _SAVE_THREE, str(tmp_path), str(files)], env=env, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    written = ["rank-00000.safetensors", "meta.json", "index.json"][: files - 6]
    assert sorted(os.listdir(tmp_path / ".tmp-step-3")) == sorted(written)
    assert ckpt.latest(tmp_path).name == "step-2" and not (tmp_path / "step-3").exists()
    state = {"w": torch.zeros(64, 32), "b": torch.zeros(5)}
    assert ckpt.load(tmp_path, state)["n"] == 2
    assert torch.equal(state["w"], torch.full((64, 32), 2.0)) and torch.equal(state["b"], torch.arange(5.0) * 2)
    # the next save clears the debris and commits normally
    ckpt.save(tmp_path, 3, {"w": torch.ones(2), "b": torch.ones(3)})
    assert not list(tmp_path.glob(".tmp-step-*")) and ckpt.latest(tmp_path).name == "step-3"


def _three_checkpoints(root):
    for step in (1, 2, 3):
        ckpt.save(root, step, {"w": torch.full((256,), float(step))}, meta={"n": step})


def _flip_a_byte(path, tensor="model.w"):
    """Alter one byte of `tensor`'s data in a safetensors file: the file stays loadable."""
    data = bytearray(path.read_bytes())
    header = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + header])[tensor]["data_offsets"]
    data[8 + header + begin + 1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksums_catch_truncated_and_altered_files_and_resume_falls_back(tmp_path):
    _three_checkpoints(tmp_path)
    index = json.loads((tmp_path / "step-3" / "index.json").read_text())
    assert set(index["files"]) == {"rank-00000.safetensors", "meta.json"}
    assert all(len(r["sha256"]) == 64 and r["bytes"] > 0 for r in index["files"].values())
    assert ckpt.verify(tmp_path / "step-3") == []
    assert ckpt.newest_intact(tmp_path) == (tmp_path / "step-3", [])

    rank_file = tmp_path / "step-3" / "rank-00000.safetensors"
    rank_file.write_bytes(rank_file.read_bytes()[:-100])  # truncated
    assert ckpt.verify(tmp_path / "step-3") == [
        f"rank-00000.safetensors has {index['files']['rank-00000.safetensors']['bytes'] - 100} bytes, the index "
        f"says {index['files']['rank-00000.safetensors']['bytes']} (truncated or extended)"
    ]
    found, rejected = ckpt.newest_intact(tmp_path)
    assert found == tmp_path / "step-2" and [p.name for p, _ in rejected] == ["step-3"]

    _flip_a_byte(tmp_path / "step-2" / "rank-00000.safetensors")  # altered: same size, still loads without a check
    assert ckpt.verify(tmp_path / "step-2") == [
        "rank-00000.safetensors does not match its SHA-256 in the index (altered)"
    ]
    state = {"w": torch.zeros(256)}
    ckpt.load(tmp_path / "step-2", state)
    assert not torch.equal(state["w"], torch.full((256,), 2.0)), "the alteration should change a value"
    found, rejected = ckpt.newest_intact(tmp_path)
    assert found == tmp_path / "step-1" and [p.name for p, _ in rejected] == ["step-3", "step-2"]

    meta = tmp_path / "step-1" / "meta.json"
    meta.write_text(meta.read_text().replace('"n": 1', '"n": 7'))
    assert ckpt.verify(tmp_path / "step-1") == ["meta.json does not match its SHA-256 in the index (altered)"]
    assert ckpt.newest_intact(tmp_path)[0] is None
    (tmp_path / "step-1" / "index.json").write_text("{")
    assert ckpt.verify(tmp_path / "step-1")[0].startswith("index.json is unreadable")
