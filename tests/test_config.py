"""launch.config: defaults < TOML < flags, and every bad input is a ValueError naming the problem and the fix."""

from pathlib import Path

import pytest

from launch.config import TrainConfig, from_toml, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "launch" / "configs"


def test_defaults_are_a_valid_single_process_run():
    cfg = load_config([])
    assert cfg == TrainConfig()
    cfg.validate(1)
    assert cfg.mesh_sizes(1) == {"fsdp": 1} and cfg.mesh_sizes(4) == {"fsdp": 4}
    assert cfg.micro_batch(1) == cfg.batch_size


def test_toml_then_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('model = "small"\nbatch_size = 32\nlr = 1\nsp = true\nmesh = "fsdp=2,tp=2"\n')
    cfg = load_config(
        [
            "--config",
            str(f),
            "--batch-size",
            "64",
            "--no-sp",
            "--grad-accum",
            "2",
            "--ckpt-dir",
            "ck",
            "--init-from-hf",
            "hf",
            "--ac",
            "selective:2",
        ]
    )
    assert (cfg.model, cfg.batch_size, cfg.lr, cfg.sp, cfg.grad_accum) == ("small", 64, 1.0, False, 2)
    assert (cfg.ckpt_dir, cfg.init_from_hf, cfg.ac) == ("ck", "hf", "selective:2")
    assert cfg.mesh_sizes(4) == {"fsdp": 2, "tp": 2} and cfg.dp_size(4) == 2 and cfg.micro_batch(4) == 16
    assert load_config(["--mesh", "fsdp=2,tp=2,sp"]).sequence_parallel()


@pytest.mark.parametrize(
    "text,match",
    [
        ("bach_size = 4\n", "unknown key 'bach_size'; did you mean 'batch_size'"),
        ('steps = "10"\n', "steps = '10' should be a int"),
        ("sp = 1\n", "sp = 1 should be a bool"),
        ("steps = [\n", "not valid TOML"),
    ],
)
def test_bad_toml(tmp_path, text, match):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        from_toml(f)


def test_missing_config_file():
    with pytest.raises(ValueError, match="does not exist"):
        load_config(["--config", "nowhere.toml"])


@pytest.mark.parametrize(
    "flags,world,match",
    [
        (
            ["--batch-size", "10", "--mesh", "dp=2,fsdp=2"],
            4,
            r"must divide by the data-parallel size \(dp\*fsdp\*ep = 4\)",
        ),
        (
            ["--batch-size", "8", "--grad-accum", "3"],
            1,
            "times --grad-accum 3 = 3; use a batch size that is a multiple of 3",
        ),
        (["--seq-len", "300"], 1, "exceeds the model's max_seq_len 256; use --seq-len 256 or less"),
        (["--ac", "selective:0"], 1, "selective:N with N >= 1"),
        (["--ac", "some"], 1, "--ac 'some' is not valid"),
        (["--dtype", "fp8"], 1, "--dtype 'fp8' is not one of fp32|bf16|fp16"),
        (
            ["--mesh", "tp=8"],
            8,
            r"Llama has 4 key/value heads, which do not split over tp=8: a rank would hold part of "
            r"a head. Pick a mesh whose tp size divides both its 8 query and 4 key/value heads \(2, 4\)",
        ),
        (["--kernels", "cuda"], 1, "--kernels 'cuda' is not one of auto|torch|triton"),
        (["--mesh", "fsdp=2,tp=2"], 2, "has 4 devices but 2 processes were started"),
        (["--mesh", "fsdp=2,tq=2"], 4, "unknown mesh axis 'tq'"),
        (["--mesh", "tp=2", "--sp", "--seq-len", "127"], 2, "must divide by tp=2"),
        (
            ["--mesh", "cp=4", "--seq-len", "100"],
            4,
            r"--seq-len: sequence length 100 does not split over cp=4: .*use a "
            r"length that is a multiple of 8 \(e.g. 96\) or a smaller cp",
        ),
        (["--mesh", "fsdp=2,cp=2", "--compile"], 4, "--compile with cp is not supported yet"),
        (["--model", "huge"], 1, "unknown model preset 'huge'"),
        (["--resume"], 1, "--resume needs --ckpt-dir"),
        (["--steps", "0"], 1, "--steps must be >= 1"),
        (["--mesh", "pp=4"], 4, "stages"),
        (["--mesh", "pp=2", "--pp-schedule", "2f2b"], 2, "2f2b"),
        (
            [
                "--mesh",
                "pp=2",
                "--pp-schedule",
                "interleaved-1f1b",
                "--virtual-stages",
                "2",
                "--microbatches",
                "3",
                "--model",
                "small",
            ],
            2,
            "multiple",
        ),
    ],
)
def test_validation_errors(flags, world, match):
    with pytest.raises(ValueError, match=match):
        load_config(flags).validate(world)


def test_several_problems_reported_together():
    with pytest.raises(ValueError) as e:
        load_config(["--dtype", "fp8", "--ac", "x"]).validate(1)
    assert "--dtype" in str(e.value) and "--ac" in str(e.value)


def test_bad_flag_value_exits_with_usage(capsys):
    with pytest.raises(SystemExit):
        load_config(["--steps", "ten"])
    assert "--steps" in capsys.readouterr().err


@pytest.mark.parametrize("name,world", [("tiny_cpu.toml", 1), ("small.toml", 4), ("llama8b_h100.toml", 64)])
def test_shipped_configs_validate(name, world):
    cfg = load_config(["--config", str(CONFIGS / name)])
    cfg.validate(world)
    assert load_config(["--config", name]) == cfg  # bare names find launch/configs/
