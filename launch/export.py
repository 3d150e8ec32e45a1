"""Export a training checkpoint to a Hugging Face directory (for Llama: a LlamaForCausalLM).

    python -m launch.export --ckpt CKPT_DIR_OR_STEP_DIR --out HF_DIR [--dtype bf16] [--max-shard-size 5GB]

Reads the model config from the checkpoint's meta.json, assembles each tensor from its shards one at a time
(memory: one tensor plus one output shard), and writes config.json and safetensors under HF names.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

import models
from spmd import checkpoint
from spmd.layout.dtypes import DTYPES

from .hf import save_hf


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B?)\s*", text, re.I)
    if not m:
        raise ValueError(f"size {text!r} is not like 5GB, 500MB or 1000000")
    unit = m.group(2).upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[unit])


class _CheckpointTensors(dict):
    """{our name: (shape, dtype)} of a checkpoint's model tensors, fetched lazily."""

    def __init__(self, path):
        super().__init__()
        self.path = path
        for key, entry in checkpoint.tensor_names(path).items():
            if key.startswith("model."):
                self[key[len("model.") :]] = (entry["shape"], getattr(torch, entry["dtype"]))

    def fetch(self, name):
        return checkpoint.read_full(self.path, "model." + name)


def export(ckpt: str, out: str, dtype: str | None = None, max_shard_size: str = "5GB"):
    meta = checkpoint.read_meta(ckpt)
    if "model_config" not in meta:
        raise ValueError(f"{ckpt}: meta.json has no model_config; export needs a checkpoint written by launch.train")
    model_cfg = models.config_from_dict(meta["model_config"], meta.get("model", models.DEFAULT))
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {tuple(DTYPES)}")
    return save_hf(
        _CheckpointTensors(ckpt), model_cfg, out, parse_size(max_shard_size), DTYPES[dtype] if dtype else None
    )


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m launch.export", description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="checkpoint dir (uses its 'latest') or a step-N dir")
    p.add_argument("--out", required=True, help="output directory for config.json + safetensors")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="cast weights (default: as stored)")
    p.add_argument("--max-shard-size", default="5GB", help="split weights into files of at most this size")
    args = p.parse_args(argv)
    try:
        files = export(args.ckpt, args.out, args.dtype, args.max_shard_size)
    except (ValueError, FileNotFoundError, KeyError) as e:
        sys.exit(f"launch.export: {e}")
    print(f"wrote {len(files)} weight file(s) and config.json to {args.out}")


if __name__ == "__main__":
    main()
