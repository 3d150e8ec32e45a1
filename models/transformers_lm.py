"""Any transformers causal LM in a local directory, through the registry: `--model hf:DIR`.

DIR holds config.json and, optionally, safetensors weights; with config.json alone the model starts from
transformers' own initialisation under the run's seed. Nothing is downloaded. The model is transformers'
class, unchanged: `spmd.annotate_hf` names its axes and its forward takes `(tokens, targets)` as the
trainer calls it, with the loss of `kernels` (vocab-parallel on sharded logits). This module is also the
model's Hugging Face adapter (launch.hf): its names are transformers' own, so export writes them as they are,
and `--init-from-hf DIR2` loads another directory of the same architecture into it, each rank reading
its slices.
"""

import json
import math
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open

from spmd import annotate_hf, checkpoint
from spmd.layout.annotate import get_axes
from spmd.layout.heads import config_problem

from .transformers_forward import train_forward, window_problem

__all__ = [
    "TransformersConfig",
    "MODEL_TYPE",
    "TIED_SOURCE",
    "tied",
    "to_hf_name",
    "from_hf_name",
    "hf_config",
    "config_from_hf",
]

MODEL_TYPE = None  # matches no config.json by type: a directory is named with --model hf:DIR
TIED_SOURCE: dict = {}


@dataclass
class TransformersConfig:
    path: str = ""
    kernels: str = "auto"  # the loss's implementation; the layers are transformers' own code
    # pipeline stages cut transformers' forward (spmd.pipeline.cut): a tied head lives on the first and last stage
    pipeline_ties = True

    @classmethod
    def preset(cls, name: str, **overrides) -> "TransformersConfig":
        if not (Path(name) / "config.json").is_file():
            raise ValueError(
                f"hf:{name}: {name} has no config.json; --model hf:DIR takes a local Hugging Face "
                f"directory (config.json, optional *.safetensors); nothing is downloaded"
            )
        problem = _config_problem(Path(name) / "config.json")
        if problem:
            raise ValueError(f"hf:{name}: {name}/config.json {problem}")
        return cls(path=str(name), **{k: v for k, v in overrides.items() if k == "kernels"})

    @property
    def hf(self) -> dict:
        return json.loads((Path(self.path) / "config.json").read_text())

    def _get(self, *keys):
        hf = self.hf
        return next(hf[k] for k in keys if k in hf)

    @property
    def vocab_size(self) -> int:
        return self._get("vocab_size")

    @property
    def max_seq_len(self) -> int:
        return self._get("max_position_embeddings", "n_positions")

    @property
    def n_layers(self) -> int:
        return self._get("num_hidden_layers", "n_layer")

    @property
    def tie_embeddings(self) -> bool:
        return bool(self.hf.get("tie_word_embeddings", True))

    def build(self) -> nn.Module:
        """The transformers model (weights from DIR when it has them and the build is not on meta)."""
        import transformers

        on_meta = torch.empty(()).device.type == "meta"
        if _has_weights(self.path) and not on_meta:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                self.path, local_files_only=True, dtype=torch.float32
            )
        else:
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(self.path, local_files_only=True)
            )
        annotate_hf(model)
        model.cfg, model.initializer = self, self.initializer  # what the trainer asks of a registered model
        model.forward = types.MethodType(train_forward, model)
        return model

    def initializer(self, seed: int | None = None):
        """fn(name, tensor) -> the value `build()` gives that parameter or buffer under `seed`; it builds one
        whole copy on the CPU, once."""
        values = {}

        def init(name: str, t: torch.Tensor) -> torch.Tensor:
            if not values:
                if seed is not None:
                    torch.manual_seed(seed)
                with torch.device("cpu"):
                    full = self.build()
                values.update(full.named_parameters(remove_duplicate=False))
                values.update(full.named_buffers())
            return values[name].detach()

        return init

    def num_params(self, non_embedding: bool = False, active: bool = False) -> int:
        """`active`: a mixture of experts' stacked experts counted for the `num_experts_per_tok` of them each
        token passes through."""
        with torch.device("meta"):
            model = self.build()
        total = sum(p.numel() for p in model.parameters())
        if active:
            stacked = [p for p in model.parameters() if "experts" in (get_axes(p) or ())]
            total -= sum(p.numel() - p.numel() // p.shape[0] * self.hf["num_experts_per_tok"] for p in stacked)
        if non_embedding:  # the input and output embeddings, as models/llama.py counts them
            tables = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
            head = model.get_output_embeddings()
            if head is not None:
                tables[id(head.weight)] = head.weight
            total -= sum(w.numel() for w in tables.values())
        return total

    def flops_per_token(self, seq_len: int) -> float:
        heads = self._get("num_attention_heads", "n_head")
        head_dim = self._get("hidden_size", "n_embd") // heads
        attention = 12 * self.n_layers * heads * head_dim * seq_len
        return 6 * self.num_params(non_embedding=True, active=True) + attention

    def mesh_problem(self, sizes: dict) -> str | None:
        drop = {
            k: v for k in ("attn_pdrop", "attention_dropout") if isinstance(v := self.hf.get(k), (int, float)) and v
        }
        if drop and math.prod(sizes.values()) > 1 and not torch.cuda.is_available():
            # SDPA's CPU kernel has no dropout: its math fallback adds a plain dropout mask to sharded scores
            return (
                f"attention dropout {drop} (config.json of {self.path}) runs inside "
                f"scaled_dot_product_attention, which DTensor cannot apply on CPU; set it to 0.0 in config.json "
                f"(other dropouts work)"
            )
        if sizes.get("cp", 1) > 1 and (problem := window_problem(self.hf)):
            return f"{problem} (config.json of {self.path})"
        problem = config_problem(self.hf, sizes, self.hf.get("model_type", "the model"))
        return None if problem is None else f"{problem} (config.json of {self.path})"

    def init_problem(self, hf_dir: str) -> str | None:
        """Why `--init-from-hf hf_dir` cannot initialise this model, or None: the architecture and every
        tensor's name and shape, from config.json and the safetensors headers alone (no weights read)."""
        path = Path(hf_dir)
        if not (path / "config.json").is_file() or not _has_weights(hf_dir):
            return f"{hf_dir} needs config.json and *.safetensors weights (nothing is downloaded)"
        theirs, ours = json.loads((path / "config.json").read_text()).get("model_type"), self.hf.get("model_type")
        if theirs != ours:
            return (
                f"{hf_dir} holds a {theirs!r} model but --model hf:{self.path} is {ours!r}; pass a directory "
                f"of the same architecture, or train --model hf:{hf_dir} itself"
            )
        shapes = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                shapes.update({k: tuple(h.get_slice(k).get_shape()) for k in h.keys()})
        with torch.device("meta"):
            want = {n: tuple(t.shape) for n, t in checkpoint.model_state(self.build()).items()}
        wrong = [f"{n} {shapes.get(n, 'missing')} (model {s})" for n, s in want.items() if shapes.get(n) != s]
        wrong += [f"{n} (not in the model)" for n in shapes if n not in want and not n.endswith("inv_freq")]
        if wrong:
            return (
                f"its tensors do not fit --model hf:{self.path}: {wrong[:6]}; pass a directory whose "
                f"config.json has the same sizes as {self.path}/config.json"
            )
        return None

    def to_dict(self) -> dict:
        return asdict(self)


# each entry: one field under its alternative names; each must be a positive integer
_REQUIRED = (("vocab_size",), ("num_hidden_layers", "n_layer"), ("max_position_embeddings", "n_positions"))
_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "n_embd",
    "n_head",
    "n_inner",
    "head_dim",
)


def _config_problem(path: Path) -> str | None:
    """What makes a config.json unusable (None: fine), caught here rather than deep inside transformers."""
    try:
        hf = json.loads(path.read_text())
    except ValueError as e:
        return f"is not valid JSON ({e})"
    if not isinstance(hf, dict):
        return "does not hold a JSON object"
    for names in _REQUIRED:
        if not any(n in hf for n in names):
            return f"has no {' or '.join(repr(n) for n in names)}; add it (a positive integer)"
    for key in [n for names in _REQUIRED for n in names] + list(_SIZES):
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            return f"has {key} = {value!r}; it must be a positive integer"
    return None


def _has_weights(path: str) -> bool:
    return any(Path(path).glob("*.safetensors"))


# ------------------------------------------------------------------------------ Hugging Face adapter
def tied(cfg: TransformersConfig) -> set:
    return set()  # a tied weight is one parameter here: it is written once, under its own name


def to_hf_name(name: str) -> str:
    return name


def from_hf_name(name: str) -> str:
    return name


def hf_config(cfg: TransformersConfig, dtype: torch.dtype = torch.float32) -> dict:
    dt = str(dtype).removeprefix("torch.")
    return {**cfg.hf, "torch_dtype": dt, "dtype": dt}


def config_from_hf(hf: dict) -> TransformersConfig:
    raise ValueError(
        "a transformers directory is trained with --model hf:DIR (and --init-from-hf DIR2 loads "
        "the weights of DIR2 into it)"
    )
