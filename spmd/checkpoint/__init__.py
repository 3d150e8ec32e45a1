"""Sharded safetensors checkpoints that load onto any mesh. No pickle touches the disk.

A checkpoint is a directory `<ckpt_dir>/step-N/`:

    rank-00000.safetensors ...   each rank's LOCAL shards (one writer per distinct slice; replicas skip)
                                 plus that rank's RNG states under `__rng__.cpu` / `__rng__.cuda`
    index.json                   every tensor's global shape and dtype, and per file the slice it holds
                                 (`offsets` and `lengths` per dim); every file's size and SHA-256
    meta.json                    step, world size and whatever the caller passes (config, data position)

Tensor names are `model.<parameter name>` and `optim.<parameter name>.<state key>` (AdamW: `exp_avg`,
`exp_avg_sq`, `step`). Loading builds each local shard of the *target* layout from the slices of the files
that overlap it (`safe_open(...).get_slice`), so a checkpoint written on `fsdp=4` loads on `fsdp=2,tp=2`
or into plain tensors in one process.

Atomic commit: every rank writes into `<ckpt_dir>/.tmp-step-N`; once all ranks report success, rank 0
writes meta.json and the index, renames the directory to `step-N`, and replaces the `latest` pointer file with
`os.replace`. A process killed mid-save leaves only a `.tmp-*` directory behind (cleared by the next save);
`latest` keeps pointing at the previous complete checkpoint. `verify(step_dir)` recomputes the checksums;
`newest_intact(ckpt_dir)` finds the newest checkpoint that passes, for a resume.

    save(ckpt_dir, step, model_state(model), optim_state(model, opt), meta={...})
    AsyncSaver().save(...)   # the same, returning once the state is in host memory; a thread writes and commits
    meta = load(ckpt_dir, model_state(model), optim_state(model, opt, init=True))
"""

from .async_save import AsyncSaver
from .load import latest, load, read_full, read_into, read_meta, resolve, tensor_names
from .save import save
from .state import model_state, optim_state
from .verify import newest_intact, verify

__all__ = [
    "save",
    "AsyncSaver",
    "load",
    "resolve",
    "latest",
    "model_state",
    "optim_state",
    "read_full",
    "read_into",
    "tensor_names",
    "read_meta",
    "verify",
    "newest_intact",
]
