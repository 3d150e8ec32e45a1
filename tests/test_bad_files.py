"""Bad files and bad specs given to launch.train: each ends with exit code 2 and a message naming the problem,
never a traceback, and leaves every file it was given (a checkpoint above all) byte for byte as it was.

One table: each row damages a copy of a one-step checkpoint (or writes a config), runs the trainer's own entry
(`launch.train.main`, the exit-code path of the command line) in this process, and checks the code, the message
and that the files are unchanged. Mutations killed (each checked once): dropping the shape check in
spmd/checkpoint/load.py `_check_stored` (wrong-shape row: a RuntimeError from torch's copy), dropping the dtype
check in `read_into` (wrong-dtype row: loads silently, exit 0 after training), dropping `outside_problem` from
verify.py and load.py (the `../x` row: reads the file outside the directory and trains), dropping
`_config_problem` in models/transformers_lm.py (StopIteration from `_get`; a negative size reaches torch).
The four-rank faults test (tests/test_faults_four_ranks.py) covers reading a checkpoint of several files.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import launch.train as T
from spmd.checkpoint.verify import file_record
from tests.test_train import SMALL

pytestmark = pytest.mark.usefixtures("isolated_trainer")

RANK_FILE = "rank-00000.safetensors"
KEY = "model.tok_embeddings.weight"


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _rewrite(step: Path, change) -> None:
    """Replace the rank file's tensors by `change(tensors)` and record the new file's checksum in the index, as
    a writer with a bug would: the checksum passes, the content disagrees with the index."""
    tensors = load_file(str(step / RANK_FILE))
    save_file(change(tensors), str(step / RANK_FILE))
    index = json.loads((step / "index.json").read_text())
    index["files"][RANK_FILE] = file_record(step / RANK_FILE)
    (step / "index.json").write_text(json.dumps(index))


def _truncate(ck):
    f = ck / "step-1" / RANK_FILE
    f.write_bytes(f.read_bytes()[:-1000])


def _flip(ck):
    f = ck / "step-1" / RANK_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _wrong_shape(ck):
    _rewrite(ck / "step-1", lambda t: {**t, KEY: t[KEY][:-1].clone()})


def _wrong_dtype(ck):
    _rewrite(ck / "step-1", lambda t: {**t, KEY: t[KEY].double()})


def _outside(ck):
    """The index names `../x`, a copy of the rank file beside the checkpoint, with its true checksum."""
    step = ck / "step-1"
    shutil.copy(step / RANK_FILE, ck / "x")
    index = json.loads((step / "index.json").read_text())
    index["files"]["../x"] = index["files"].pop(RANK_FILE)
    for entry in index["tensors"].values():
        for shard in entry["shards"]:
            shard["file"] = "../x"
    (step / "index.json").write_text(json.dumps(index))


def _no_index(ck):
    (ck / "step-1" / "index.json").unlink()


def _hf_config(**fields):
    def write(root):
        hf = {
            "model_type": "llama",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "max_position_embeddings": 128,
            **fields,
        }
        (root / "hf").mkdir()
        (root / "hf" / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))

    return write


def _toml(text):
    return lambda root: (root / "c.toml").write_text(text)


RESUME = ["--ckpt-dir", "{ck}", "--resume"]
ROWS = [  # (name, damage(dir), flags, exit code, message fragment)
    ("truncated shard", _truncate, RESUME, 2, f"step-1: {RANK_FILE} has"),
    ("flipped byte", _flip, RESUME, 2, f"{RANK_FILE} does not match its SHA-256 in the index (altered)"),
    ("wrong shape", _wrong_shape, RESUME, 2, f"{RANK_FILE} holds shape [511, 64] where the index says [512, 64]"),
    ("wrong dtype", _wrong_dtype, RESUME, 2, f"{RANK_FILE} holds torch.float64 where the index says float32"),
    ("index names ../x", _outside, RESUME, 2, "names file '../x', which is not a file inside the checkpoint"),
    ("missing index", _no_index, RESUME, 2, "'latest' points at it but it has no index.json"),
    (
        "hf field missing",
        _hf_config(max_position_embeddings=None),
        ["--model", "hf:{root}/hf"],
        2,
        "config.json has no 'max_position_embeddings' or 'n_positions'",
    ),
    (
        "hf field absurd",
        _hf_config(hidden_size=-64),
        ["--model", "hf:{root}/hf"],
        2,
        "config.json has hidden_size = -64; it must be a positive integer",
    ),
    ("toml wrong type", _toml('steps = "ten"\n'), ["--config", "{root}/c.toml"], 2, "steps = 'ten' should be a int"),
    (
        "toml unknown key",
        _toml("stepz = 10\n"),
        ["--config", "{root}/c.toml"],
        2,
        "unknown key 'stepz'; did you mean 'steps'?",
    ),
    ("mesh axis twice", None, ["--mesh", "fsdp=1,fsdp=1"], 2, "mesh axis 'fsdp' appears twice"),
    ("mesh axis unknown", None, ["--mesh", "fsdp=1,qq=1"], 2, "unknown mesh axis 'qq'; allowed axes are"),
]


@pytest.fixture(scope="module")
def one_step_checkpoint(tmp_path_factory):
    ck = tmp_path_factory.mktemp("pristine") / "ck"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(T, "peak_flops", lambda dtype, device: (1e11, "test"))
        assert T.main([*SMALL, "--steps", "1", "--ckpt-dir", str(ck), "--ckpt-every", "1"]) == 0
    return ck


@pytest.mark.parametrize("name, damage, flags, code, fragment", ROWS, ids=[r[0] for r in ROWS])
def test_a_bad_file_is_a_clear_error_and_nothing_is_lost(
    name, damage, flags, code, fragment, tmp_path, capsys, one_step_checkpoint
):
    ck = tmp_path / "ck"
    shutil.copytree(one_step_checkpoint, ck)
    if damage:
        damage(ck if flags is RESUME else tmp_path)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    argv = [*SMALL, "--steps", "2", *[f.format(ck=ck, root=tmp_path) for f in flags]]
    assert T.main(argv) == code
    err = capsys.readouterr().err
    assert fragment in err and "launch.train: error:" in err and "Traceback" not in err, err[-2000:]
    assert _snapshot(tmp_path) == before, "the run changed or removed a file it was given"
    torch.manual_seed(0)  # the run seeded the global generator: leave it as other tests expect
