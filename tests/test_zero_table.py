"""The ZeRO paper's Table 1 row for 64 devices, from `spmd.explain` on a fake world of 64 ranks; bad ZeRO
settings; a stage with no data axis to shard over.

Rajbhandari et al. (2020), Table 1: model-state memory per device for Ψ = 7.5B parameters with mixed-precision
Adam (K = 12), N = 64: 31.4 GB (stage 1: 4Ψ + KΨ/N), 16.6 GB (stage 2: 2Ψ + (2+K)Ψ/N), 1.88 GB (stage 3:
(4+K)Ψ/N). The paper's layout is `dtype=bf16, reduce_dtype=bf16, master="optimizer"`: bf16 parameters and
gradients, the fp32 master and two fp32 moments with the optimizer. The model is Llama-shaped (4 wide blocks
of dim 8192, GQA, SwiGLU 64000, vocab 32000, every weight divisible by 64; few blocks keep the
64-rank dry run short; Ψ = 7.420B) so that the plan's bytes equal the formulas exactly for its own Ψ; scaled by 7.5B/Ψ
they are the paper's figures within 0.3% (measured: stage 1 +0.02%, stage 2 +0.24%, stage 3 -0.27%: the
paper rounds). The plan's bytes equal the formulas exactly; kills the fp32 master copy counted in the
parameters' dtype (tests/mutants.py).
"""

import pytest
import torch

import spmd
from models.llama import Llama, LlamaConfig

N = 64
PAPER_GB = {1: 31.4, 2: 16.6, 3: 1.88}
K = 12


def _formula(stage: int, psi: int) -> dict:
    return {
        1: {"parameters": 2 * psi, "gradients": 2 * psi, "optimizer": K * psi // N},
        2: {"parameters": 2 * psi, "gradients": 2 * psi // N, "optimizer": K * psi // N},
        3: {"parameters": 2 * psi // N, "gradients": 2 * psi // N, "optimizer": K * psi // N},
    }[stage]


@pytest.mark.slow
def test_explain_reproduces_zero_paper_table_1_for_64_devices():
    cfg = LlamaConfig(
        dim=8192, n_layers=4, n_heads=64, n_kv_heads=8, ffn_dim=64000, vocab_size=32000, max_seq_len=16, kernels="torch"
    )
    with torch.device("meta"):
        model = Llama(cfg)
    psi = sum(p.numel() for p in model.parameters())
    assert 7.0e9 < psi < 8.0e9
    for stage, paper in PAPER_GB.items():
        plan = spmd.explain(
            model,
            spmd.Rules.default(zero=stage),
            {"fsdp": N},
            batch_shape=(N, 16),
            dtype=torch.bfloat16,
            reduce_dtype=torch.bfloat16,
            master="optimizer",
        )
        states = {k: plan.memory[k] for k in ("parameters", "gradients", "optimizer")}
        assert states == _formula(stage, psi), (stage, states)
        scaled = sum(states.values()) * 7.5e9 / psi / 1e9
        print(
            f"stage {stage}: {sum(states.values()) / 1e9:.3f} GB at Ψ={psi / 1e9:.3f}B, scaled to 7.5B "
            f"{scaled:.3f} GB, paper {paper} GB, ratio {scaled / paper:.4f}"
        )
        assert abs(scaled - paper) <= 0.003 * paper, (stage, scaled, paper)


def test_bad_zero_settings_fail_naming_the_fix():
    from launch.config import TrainConfig
    from tests.spmd_cases import tiny_model

    with pytest.raises(ValueError, match=r"ZeRO stage 4 is not one of \(0, 1, 2, 3\)"):
        spmd.Rules.default(zero=4)
    with pytest.raises(ValueError, match="optimizer rule 'embed'.*may only add sharding"):
        spmd.Rules({"embed": "tp"}, optimizer={"embed": "fsdp"})
    with pytest.raises(ValueError, match="master='fp32' is not one of"):
        spmd.parallelize(tiny_model(), None, spmd.Rules.default(), master="fp32")
    with pytest.raises(ValueError, match="offload='disk' is not supported; use None, 'optimizer'.*'params'"):
        spmd.parallelize(tiny_model(), None, spmd.Rules.default(), offload="disk")
    with pytest.raises(
        ValueError,
        match="offload='params' keeps stage-3 parameter shards on the host, but "
        "'tok_embeddings.weight' is stored.*use Rules.default\\(zero=3\\)",
    ):
        spmd.explain(tiny_model(), spmd.Rules.default(zero=2), {"fsdp": 4}, (8, 16), offload="params")
    problems = [
        (dict(zero=4), "--zero 4 is not a ZeRO stage; use 1"),
        (dict(master="host"), "--master 'host' is not one of params|optimizer"),
        (dict(offload="params", zero=2), "--offload params keeps stage-3 .*--zero 2.*use --zero 3"),
        (dict(offload="params", compile=True), "--offload params with --compile is not supported"),
        (dict(offload="nvme:"), "--offload 'nvme:' is not supported; use --offload optimizer.*nvme:DIR"),
    ]
    for fields, message in problems:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**fields).validate(4)
    for zero, offload in ((0, ""), (1, ""), (2, ""), (1, "optimizer"), (2, "nvme:/tmp/x"), (3, "params")):
        TrainConfig(mesh="pp=2,fsdp=2", zero=zero, offload=offload).validate(4)  # (tests/test_pipeline.py)
    for zero in (1, 2):
        TrainConfig(zero=zero, compile=True).validate(4)  # (tests/test_compile.py)


def test_a_stage_without_a_data_axis_to_shard_over_is_stage_3():
    """On tp=4 (fsdp size 1) every map lays a parameter out alike: no masters, nothing gathered after the
    step, the same bytes as the default rules."""
    from tests.spmd_cases import BATCH, SEQ, tiny_model

    plans = [
        spmd.explain(tiny_model(), spmd.Rules.default(zero=z), {"tp": 4}, batch_shape=(BATCH, SEQ)) for z in (1, 3)
    ]
    assert plans[0].comm_bytes("optimizer") == 0
    assert plans[0].memory == plans[1].memory
    assert [c.to_dict() for c in plans[0].collectives] == [c.to_dict() for c in plans[1].collectives]


def test_explain_with_pp_plans_each_stage_offloaded():
    """With a pp axis, explain lays every stage out with the offload it is given: under
    offload="optimizer" the AdamW states and the fp32 master copies (K + 1 = 3 of the parameter's shard bytes
    against the K = 2 states of a master that is a view of the parameter) leave the device for the host;
    the parameters and gradients stay; the optimizer step's all-gather of updated shards is in the plan."""
    from tests.spmd_cases import BATCH, SEQ, tiny_model

    sizes = {"pp": 2, "fsdp": 2}
    on_device, offloaded = (
        spmd.explain(
            tiny_model(),
            spmd.Rules.default(zero=1),
            sizes,
            batch_shape=(BATCH, SEQ),
            schedule="1f1b",
            microbatches=2,
            offload=offload,
        )
        for offload in (None, "optimizer")
    )
    assert offloaded.memory["optimizer"] == 0
    assert offloaded.memory["optimizer_host"] * 2 == on_device.memory["optimizer"] * 3
    assert offloaded.memory["parameters"] == on_device.memory["parameters"] > 0
    assert offloaded.memory["gradients"] == on_device.memory["gradients"] > 0
    assert on_device.comm_bytes("optimizer") > 0
