"""`python -m spmd.explain`: prints the plan of one training step (spmd.cli.explain_main):

    python -m spmd.explain --model 8b --mesh fsdp=8,tp=8,sp --batch 8 --seq 4096 --dtype bf16 [--ac full]
                           [--grad-accum 2] [--json FILE] [--zero 1|2|3] [--master params|optimizer]
                           [--reduce-dtype fp32|bf16] [--offload optimizer|params|nvme:DIR] [--optimizer adamw|muon]
    python -m spmd.explain --config launch/configs/tiny_rules.toml [flags]   # the trainer's file and its rules

prints `plan.table()` of a registry model (meta tensors, no devices) laid out by the default rules of ZeRO
stage `--zero`, or by the [rules.*] tables of `--config FILE`; `--model hf:DIR` plans the transformers model of a local
Hugging Face directory (config.json is enough). In code, `spmd.explain(model, rules, {"fsdp": 8, "tp": 8},
batch_shape=(8, 4096))`.
"""

from spmd.cli import explain_main, run_command

__all__: list[str] = []

run_command(__name__, explain_main)
