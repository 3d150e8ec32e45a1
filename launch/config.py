"""Training configuration: one dataclass, filled from defaults, then a TOML file, then command-line flags.

    cfg = load_config(sys.argv[1:])        # --config FILE.toml and flags like --batch-size 16
    cfg.validate(world_size)               # every rank, before any collective: ValueError naming problem + fix

TOML files hold the same keys as the dataclass (`batch_size = 16`); flags are the same names with dashes
(`--batch-size 16`). A TOML file may also state the layout rules as data (`[rules.compute]`, `[rules.params]`,
`[rules.grads]`, `[rules.optimizer]`: spmd.layout.rules_table) instead of `sp` and `zero`. The defaults are a
short CPU run of the tiny model on the Python standard library that shows the loss falling from 6.2 to about
2 in 15-20 s on two idle cores (longer on a busy machine).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path

import models
from spmd.layout.mesh import parse_spec
from spmd.layout.rules import Rules
from spmd.layout.rules_table import check_rules_flags, read_toml, rules_from_table
from spmd.pipeline.runtime import default_microbatches

from .config_checks import config_problems, flag_name

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass
class TrainConfig:
    # model and layout
    model: str = "tiny"  # tiny | small | 1b | 8b | 70b | moe-tiny | moe-small | moe-8x7b, or MODEL:PRESET
    mesh: str = ""  # "fsdp=2,tp=2" (may end in ",sp"); empty: fsdp over every process
    sp: bool = False  # sequence parallelism (activations sharded over tp along seq)
    # optimisation
    steps: int = 150
    batch_size: int = 16  # global batch, in sequences
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per step (the global batch stays batch_size)
    lr: float = 3e-3  # peak learning rate
    warmup: int = 15  # linear warmup steps, then cosine decay to 10% of lr at `steps`
    weight_decay: float = 0.1
    optimizer: str = "adamw"  # adamw | muon (spmd.Muon on hidden matrices at --muon-lr, AdamW at --lr on the rest)
    # | onebit-adam (spmd.OneBitAdam: exact AdamW for --onebit-warmup steps, then 1-bit compressed momentum)
    muon_lr: float = 0.02  # Muon's peak lr (its update is scaled to unit spectral norm, not AdamW's)
    onebit_warmup: int = 100  # --optimizer onebit-adam: exact AdamW steps before the variance freezes
    max_grad_norm: float = 1.0  # global-norm clipping; 0 disables
    max_bad_steps: int = 5  # stop after this many consecutive non-finite steps (skipped); 0: never stop
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (compute dtype; master weights stay fp32)
    ac: str = "none"  # activation checkpointing: none | full | selective:N (every N-th block)
    zero: int = 3  # ZeRO stage: 1 shards optimizer states over fsdp, 2 + gradients, 3 + parameters
    master: str = "params"  # fp32 master weights with --dtype bf16/fp16: params | optimizer (spmd.parallelize)
    offload: str = ""  # "" | optimizer | params | nvme:DIR: AdamW states and fp32 masters on the host
    # (params: stage-3 parameter shards too; nvme: states in files)
    comm_params: str = ""  # "" | int8 | fp8 | float8: parameter all-gathers in a wire format (qwZ)
    comm_grads: str = ""  # "" | int8 | int4: gradient reductions quantized, summed in fp32 (qgZ)
    hpz: str = ""  # mesh axis of hpZ's secondary parameter shards (backward regathers inside it)
    compile: bool = False  # torch.compile each block (spmd.compile_blocks), checkpointed ones too
    float8: bool = False  # linear layers compute in float8 (torchao, tensorwise dynamic scales; spmd.float8_training)
    kernels: str = "auto"  # auto | torch | triton: the model's RMSNorm/SwiGLU/RoPE/CE implementation
    # data
    data: str = "stdlib"  # stdlib | PATH_OR_GLOB of text/.jsonl/.parquet files | datasets dir | FILE.bin
    data_field: str = "text"  # the text field of .jsonl/.parquet/datasets records
    tokenizer: str = "bytes"  # bytes | path/to/tokenizer.json
    seed: int = 0
    # validation (launch/validate.py)
    val_data: str = ""  # like --data; empty: a held-out tail of --data that training never reads
    val_every: int = 0  # steps between validations (and after the last step); 0: no validation
    val_batches: int = 10  # batches of batch_size x seq_len tokens each validation evaluates
    # checkpoints
    ckpt_dir: str = ""  # empty: no checkpoints
    ckpt_every: int = 0  # steps between checkpoints; 0: only at the end (and on SIGTERM/SIGINT)
    ckpt_keep: int = 3  # newest checkpoints kept; 0 keeps all
    ckpt_async: bool = True  # the loop waits for the copy to host memory only; a thread writes and commits
    resume: bool = False  # continue from ckpt_dir/latest when there is one
    init_from_hf: str = ""  # Hugging Face directory to initialise weights from
    # metrics
    metrics: str = ""  # JSONL file, one line per step
    tensorboard: str = ""  # tensorboard log directory
    log_every: int = 1  # steps between JSONL/tensorboard/W&B records
    wandb: str = ""  # Weights & Biases project (offline unless WANDB_MODE is set)
    # profiling (launch/profile.py)
    profile_steps: str = ""  # "A:B": torch.profiler trace (+ CUDA memory snapshot) of steps A..B
    profile_dir: str = "profile"  # where the rank-tagged trace files go
    # pipeline parallelism (a pp axis in --mesh)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved-1f1b | zero-bubble | zbv
    microbatches: int = 0  # pipeline micro-batches per step (per --grad-accum micro-batch); 0: a default
    virtual_stages: int = 1  # stages per pp rank (interleaved schedules)
    # failures
    collective_timeout: float = 600.0  # seconds a collective waits for a dead or stuck rank before failing
    # the TOML file's [rules.*] tables (no flag): when set, they are the layout instead of Rules.default
    rules_table: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ derived
    def mesh_sizes(self, world_size: int) -> dict[str, int]:
        """Mesh axis sizes; an empty mesh means fsdp over every process."""
        sizes, _ = self.parse_mesh()
        return sizes or {"fsdp": world_size}

    def sequence_parallel(self) -> bool:
        return self.sp or "sp" in self.parse_mesh()[1]

    def rules(self) -> Rules:
        if self.rules_table:
            return rules_from_table(self.rules_table, "the config's [rules]")
        return Rules.default(sequence_parallel=self.sequence_parallel(), zero=self.zero)

    def comm(self) -> dict | None:
        """spmd.parallelize's `comm` from --comm-params, --comm-grads and --hpz (None: nothing set)."""
        comm = {"params": self.comm_params, "grads": self.comm_grads, "hpz": self.hpz}
        return {k: v for k, v in comm.items() if v} or None

    def dp_size(self, world_size: int) -> int:
        return self.rules().data_parallel_size(self.mesh_sizes(world_size))

    def micro_batch(self, world_size: int) -> int:
        """Sequences per rank per micro-batch."""
        return self.batch_size // (self.dp_size(world_size) * self.grad_accum)

    def pipeline_microbatches(self, world_size: int) -> int:
        """Micro-batches the pipeline schedule splits each --grad-accum micro-batch into."""
        if self.microbatches:
            return self.microbatches
        return default_microbatches(self.pp_schedule, self.mesh_sizes(world_size).get("pp", 1))

    def model_config(self):
        """The registry's config for --model (`PRESET` of the default model, or `MODEL:PRESET`)."""
        return models.preset(self.model, kernels=self.kernels)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ checks
    def validate(self, world_size: int = 1, model_cfg=None) -> TrainConfig:
        """Raise ValueError (problem and fix) for anything that would fail later. No collectives."""
        problems = config_problems(self, world_size, model_cfg)
        if problems:
            raise ValueError("invalid training config:\n  - " + "\n  - ".join(problems))
        return self

    def parse_mesh(self):
        """(sizes, flags) of --mesh; a bad spec is a ValueError with an example."""
        try:
            return parse_spec(self.mesh)
        except ValueError as e:
            raise ValueError(f"--mesh {self.mesh!r}: {e}. Example: --mesh fsdp=2,tp=2") from None


def _check_type(name: str, value, default, source: str):
    """TOML values must have the field's type (ints are accepted for floats)."""
    kind = type(default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"{source}: {name} = {value!r} should be a {kind.__name__} (like {name} = {default!r})")
    return value


def _read(path: str | Path) -> tuple[Path, dict]:
    path = Path(path)
    if not path.is_file() and (CONFIG_DIR / path).is_file():
        path = CONFIG_DIR / path  # `--config tiny_cpu.toml` finds the shipped examples
    return path, read_toml(path)


def from_toml(path: str | Path, base: TrainConfig | None = None) -> TrainConfig:
    """Values from a TOML file on top of `base` (defaults). Unknown keys are an error naming them."""
    return _apply(*_read(path), base)


def _apply(path: Path, data: dict, base: TrainConfig | None) -> TrainConfig:
    cfg = dataclasses.replace(base or TrainConfig())
    known = {f.name: f for f in fields(TrainConfig) if f.name != "rules_table"}
    for key, value in data.items():
        if key == "rules":
            cfg.rules_table = value
            rules_from_table(value, f"config file {path}")  # a bad table is an error naming its key
            continue
        if key not in known:
            import difflib

            hint = difflib.get_close_matches(key, known, n=1)
            raise ValueError(
                f"config file {path}: unknown key {key!r}"
                + (f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(known)}")
            )
        setattr(cfg, key, _check_type(key, value, known[key].default, f"config file {path}"))
    return cfg


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun --standalone --nproc-per-node N -m launch.train",
        description="Train a model of models.MODELS with spmd. Defaults < --config TOML < command-line flags.",
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="TOML file with the keys below (underscores: batch_size = 16)")
    helps = {
        "model": "model preset: tiny|small|1b|8b|70b, moe-tiny|moe-small|moe-8x7b (or MODEL:PRESET)",
        "mesh": "mesh spec, e.g. fsdp=2,tp=2 or fsdp=2,cp=2 (default: fsdp=N)",
        "sp": "sequence parallelism",
        "steps": "optimizer steps",
        "batch_size": "global batch in sequences",
        "seq_len": "tokens per sequence",
        "grad_accum": "micro-batches per step",
        "lr": "peak learning rate",
        "warmup": "warmup steps",
        "dtype": "fp32|bf16|fp16",
        "ac": "none|full|selective:N",
        "data": "stdlib | PATH_OR_GLOB (text, .jsonl, .parquet) | datasets.save_to_disk DIR | FILE.bin",
        "data_field": "text field of .jsonl/.parquet/datasets records",
        "tokenizer": "bytes | tokenizer.json",
        "ckpt_dir": "checkpoint directory",
        "ckpt_every": "checkpoint every N steps (0: at the end)",
        "ckpt_async": "write checkpoints in a background thread (--no-ckpt-async: the loop waits for the files)",
        "resume": "resume from CKPT_DIR/latest if present",
        "init_from_hf": "initialise from a Hugging Face directory",
        "metrics": "JSONL metrics file",
        "tensorboard": "tensorboard log directory",
        "seed": "data/init seed",
        "wandb": "Weights & Biases project (offline unless WANDB_MODE is set; needs spmd[wandb])",
        "pp_schedule": "gpipe|1f1b|interleaved-1f1b|zero-bubble|zbv",
        "microbatches": "pipeline micro-batches (0: 1 or 2 per pp rank)",
        "virtual_stages": "pipeline stages per pp rank",
        "profile_steps": "A:B: profiler trace (+ CUDA memory snapshot) of steps A..B, counted from 1",
        "profile_dir": "directory for the profiler's rank-tagged files",
        "max_bad_steps": "stop after N consecutive non-finite steps (0: never)",
        "collective_timeout": "seconds a collective waits for a dead or stuck rank",
        "optimizer": "adamw | muon: Muon on the hidden matrices (whole, on one rank each), AdamW on the rest | "
        "onebit-adam: 1-bit Adam (momentum all-reduced as signs and scales after --onebit-warmup steps)",
        "onebit_warmup": "--optimizer onebit-adam: exact AdamW steps before the variance freezes (then compression)",
        "muon_lr": "Muon's peak learning rate (the schedule scales it as it scales --lr)",
        "zero": "ZeRO stage 0|1|2|3: which states fsdp shards (1 optimizer, 2 + gradients, 3 + parameters)",
        "master": "params|optimizer: where fp32 master weights live under --dtype bf16/fp16",
        "val_data": "validation data, formats as --data (default: a held-out 1%% tail of --data)",
        "val_every": "validate every N steps and after the last (0: never)",
        "val_batches": "batches each validation evaluates",
        "float8": "block linear layers compute in float8 through torchao (spmd.float8_training; the output head "
        "stays in --dtype; emulated off CUDA GPUs of sm89+; needs spmd[float8])",
        "offload": "optimizer | params | nvme:DIR: AdamW states and fp32 masters in host memory (params: stage-3 "
        "parameter shards too; nvme: files under DIR), the step on the CPU",
        "comm_params": "int8 | fp8 | float8: parameter all-gathers as block-quantized codes + fp32 scales (ZeRO++ "
        "qwZ); float8: float8 layers' weights in float8 with their tensorwise scales (with --float8)",
        "comm_grads": "int8 | int4: gradient reductions by a quantized all-to-all, summed in fp32 (ZeRO++ qgZ)",
        "hpz": "AXIS: keep a secondary parameter shard over AXIS so backward regathers inside it (ZeRO++ hpZ)",
    }
    for f in fields(TrainConfig):
        if f.name == "rules_table":  # TOML only
            continue
        flag = "--" + flag_name(f.name)
        h = helps.get(f.name, f.name.replace("_", " ")) + f" (default: {f.default!r})"
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=h)
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, type(f.default))
            p.add_argument(flag, dest=f.name, type=typ, metavar=f.name.upper(), help=h)
    return p


def load_config(argv: list[str] | None = None) -> TrainConfig:
    """Defaults, then --config FILE, then flags. Does not validate (call `validate(world_size)`)."""
    args = vars(parser().parse_args(argv))
    cfg, given, path = TrainConfig(), set(args) - {"config"}, None
    if "config" in args:
        path, data = _read(args.pop("config"))
        cfg, given = _apply(path, data, cfg), given | set(data)
    for key, value in args.items():
        setattr(cfg, key, value)
    if cfg.rules_table:
        _adopt_rules(cfg, given, f"config file {path}")
    return cfg


def _adopt_rules(cfg: TrainConfig, given: set, source: str) -> None:
    """The rules table decides sp and zero; a flag or key that says otherwise is an error naming both."""
    rules = rules_from_table(cfg.rules_table, source)
    sp = True if "sp" in cfg.parse_mesh()[1] else cfg.sp if "sp" in given else None
    check_rules_flags(rules, source, cfg.zero if "zero" in given else None, sp)
    cfg.zero, cfg.sp = rules.zero_stage, rules.sequence_parallel
