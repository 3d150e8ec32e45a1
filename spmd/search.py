"""`python -m spmd.search`: the spec search (spmd.search_command.search_main; in code
`spmd.search(model, 64, device="h100")`):

    python -m spmd.search --model 8b --world 8 --device h100 --batch 16 --seq 8192 [--ac full] [--grad-accum 2]
                          [--zero 1|2|3] [--max-pp 4 --pp-schedule 1f1b --microbatches 8]
    python -m spmd.search --model hf:DIR --world 8 --device h100   # a local Hugging Face directory
    python -m spmd.search --config FILE.toml --world 8              # launch.train's file: model, batch, rules

Each ranked row ends in the launch.train flags it assumes: --mesh SPEC [--zero K] --ac MODE --grad-accum K
(--zero where the mesh has an fsdp axis: each stage is a row of its own unless --zero pins one).
"""

from spmd.cli import run_command
from spmd.search_command import search_main

__all__: list[str] = []

run_command(__name__, search_main)
