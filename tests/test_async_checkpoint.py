"""spmd.checkpoint.AsyncSaver: training goes on while a save is in flight, what it commits is the state at the
moment of the call, tensor for tensor what the synchronous `save` writes, and a writer's failure on one rank
raises on every rank while `latest` keeps the previous checkpoint.

One 4-process gloo launch (the tiny Llama on fsdp=2,tp=2) holds every distributed spec. The writer thread is
held on a threading.Event, so "the loop took steps before the save committed" is an ordering, not a timing.
"""

import importlib
import json
import threading
from pathlib import Path

import pytest
import torch
from dist_utils import run_distributed
from safetensors import safe_open

import spmd
from models.llama import Llama, LlamaConfig
from spmd import checkpoint
from spmd.checkpoint import async_save

pytestmark = pytest.mark.usefixtures("isolated_trainer")


def _tiny_model(world: int):
    """The tiny Llama on fsdp=2,tp=2 (each rank building its own shards) with AdamW."""
    with torch.device("meta"):
        model = Llama(LlamaConfig.preset("tiny"))
    spmd.parallelize(model, spmd.make_mesh({"fsdp": 2, "tp": 2}), spmd.Rules.default(), param_init=model.initializer(0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, rank: int) -> None:
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(rank // 2))  # per fsdp rank
    model(x[:, :-1], x[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _held_writer(module, release: threading.Event, started: threading.Event):
    """Replaces `module.write` with one that waits for `release` (having set `started`); returns the real one."""
    real = module.write

    def write(job, group=None):
        started.set()
        release.wait()
        return real(job, group)

    module.write = write
    return real


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _index(step_dir: Path) -> dict:
    return json.loads((step_dir / "index.json").read_text())


def _in_flight_then_equal_to_sync(rank, world, root):
    root = Path(root)
    model, opt = _tiny_model(world)
    saver = checkpoint.AsyncSaver()
    release, started = threading.Event(), threading.Event()
    real_write = _held_writer(async_save, release, started)

    # 1. The save returns while its writer is held; the loop takes a step before anything is committed.
    snapshot = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    state, meta = (checkpoint.model_state(model), checkpoint.optim_state(model, opt, init=True)), {"data": [1]}
    path = saver.save(root / "async", 1, *state, meta)
    sync = checkpoint.save(root / "sync", 1, *state, meta)
    assert started.wait(60)  # a bound on a hang, not a timing: the writer has begun and is held
    _step(model, opt, rank)
    assert not path.exists() and checkpoint.latest(root / "async") is None and not saver.failed()
    release.set()
    assert saver.wait() == path and checkpoint.latest(root / "async") == path

    # 2. What it committed is the state at the call: what the synchronous save wrote, file by file and tensor
    #    by tensor (RNG states included). (Not the files' hashes: safetensors orders its metadata at random.)
    assert _index(path)["tensors"] == _index(sync)["tensors"]
    assert (path / "meta.json").read_bytes() == (sync / "meta.json").read_bytes()
    mine = checkpoint.common.rank_file(rank)
    with safe_open(str(path / mine), "pt") as fa, safe_open(str(sync / mine), "pt") as fs:
        assert sorted(fa.keys()) == sorted(fs.keys()) and checkpoint.common.RNG_CPU in fa.keys()
        for key in fa.keys():
            assert torch.equal(fa.get_tensor(key), fs.get_tensor(key)), key
    changed = 0
    for name, before in snapshot.items():
        assert torch.equal(checkpoint.read_full(path, f"model.{name}"), before), name
        changed += not torch.equal(_full(dict(model.named_parameters())[name]).detach(), before)
    assert changed == len(snapshot)  # the step taken during the save changed every parameter

    # 3. A writer failing on rank 2 raises on every rank from the next save, before it writes anything;
    #    `latest` keeps step-1; the saver then saves again.
    async_save.write = real_write
    save_module = importlib.import_module("spmd.checkpoint.save")  # the package's `save` is the function
    real_save_file = save_module.save_file
    if rank == 2:
        save_module.save_file = lambda *a, **k: (_ for _ in ()).throw(OSError("No space left on device"))
    saver.save(root / "async", 2, checkpoint.model_state(model))
    with pytest.raises(RuntimeError, match=r"step-2 failed: checkpoint save of step 2 .*rank 2: OSError: No sp"):
        saver.save(root / "async", 3, checkpoint.model_state(model))
    assert checkpoint.latest(root / "async") == path and not (root / "async" / "step-3").exists()
    save_module.save_file = real_save_file
    assert saver.save(root / "async", 3, checkpoint.model_state(model)) == root / "async" / "step-3"
    saver.close()
    assert checkpoint.latest(root / "async").name == "step-3"


@pytest.mark.slow
def test_training_goes_on_while_a_save_is_in_flight_and_the_save_equals_a_synchronous_one(tmp_path):
    run_distributed(_in_flight_then_equal_to_sync, 4, str(tmp_path), timeout_s=180)


def test_the_trainer_stops_on_a_failed_background_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """One process: the first save commits, every later one fails in its writer; the run raises that error
    (at the next step's check or the next save, whichever the writer's finish reaches first) instead of
    training on, and `latest` still names step-1. With --no-ckpt-async the same checkpoint is written."""
    import launch.train as T
    from launch.config import load_config

    save_module = importlib.import_module("spmd.checkpoint.save")
    real_save_file, calls = save_module.save_file, []

    def save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("No space left on device")
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(save_module, "save_file", save_file)
    flags = ["--batch-size", "2", "--seq-len", "16", "--steps", "4", "--ckpt-every", "1", "--warmup", "1"]
    with pytest.raises(RuntimeError, match=r"background checkpoint save to .*step-2 failed: .*No space left"):
        T.train(load_config([*flags, "--ckpt-dir", str(tmp_path / "a")]), log=False)
    assert checkpoint.latest(tmp_path / "a").name == "step-1"
    monkeypatch.setattr(save_module, "save_file", real_save_file)
    T.train(load_config([*flags, "--steps", "1", "--ckpt-dir", str(tmp_path / "s"), "--no-ckpt-async"]), log=False)
    for key in checkpoint.tensor_names(tmp_path / "s"):
        assert torch.equal(checkpoint.read_full(tmp_path / "a", key), checkpoint.read_full(tmp_path / "s", key)), key
