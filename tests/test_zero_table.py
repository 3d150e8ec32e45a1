"""The ZeRO paper's Table 1 row for 64 devices, from `spmd.explain` on a fake world of 64 ranks.

Rajbhandari et al. (2020), Table 1: model-state memory per device for Ψ = 7.5B parameters with mixed-precision
Adam (K = 12), N = 64: 31.4 GB (stage 1: 4Ψ + KΨ/N), 16.6 GB (stage 2: 2Ψ + (2+K)Ψ/N), 1.88 GB (stage 3:
(4+K)Ψ/N). The paper's layout is `dtype=bf16, reduce_dtype=bf16, master="optimizer"`: bf16 parameters and
gradients, the fp32 master and two fp32 moments with the optimizer. The model is Llama-shaped (10 blocks of
dim 8192, GQA, SwiGLU 22016, vocab 32000: Ψ = 7.445B, every weight divisible by 64) so that the plan's bytes
equal the formulas exactly for its own Ψ; scaled by 7.5B/Ψ they are the paper's figures, within 3%.
"""
import pytest
import torch

import spmd
from models.llama import Llama, LlamaConfig

N = 64
PAPER_GB = {1: 31.4, 2: 16.6, 3: 1.88}
K = 12


def _formula(stage: int, psi: int) -> dict:
    return {1: {"parameters": 2 * psi, "gradients": 2 * psi, "optimizer": K * psi // N},
            2: {"parameters": 2 * psi, "gradients": 2 * psi // N, "optimizer": K * psi // N},
            3: {"parameters": 2 * psi // N, "gradients": 2 * psi // N, "optimizer": K * psi // N}}[stage]


@pytest.mark.slow
def test_explain_reproduces_zero_paper_table_1_for_64_devices():
    cfg = LlamaConfig(dim=8192, n_layers=10, n_heads=64, n_kv_heads=8, ffn_dim=22016, vocab_size=32000,
                      max_seq_len=16, kernels="torch")
    with torch.device("meta"):
        model = Llama(cfg)
    psi = sum(p.numel() for p in model.parameters())
    assert 7.0e9 < psi < 8.0e9
    for stage, paper in PAPER_GB.items():
        plan = spmd.explain(model, spmd.Rules.default(zero=stage), {"fsdp": N}, batch_shape=(N, 16),
                            dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, master="optimizer")
        states = {k: plan.memory[k] for k in ("parameters", "gradients", "optimizer")}
        assert states == _formula(stage, psi), (stage, states)
        scaled = sum(states.values()) * 7.5e9 / psi / 1e9
        print(f"stage {stage}: {sum(states.values()) / 1e9:.3f} GB at Ψ={psi / 1e9:.3f}B, scaled to 7.5B "
              f"{scaled:.3f} GB, paper {paper} GB, ratio {scaled / paper:.4f}")
        assert abs(scaled - paper) <= 0.03 * paper, (stage, scaled, paper)
