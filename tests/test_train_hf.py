"""`launch.train --model hf:DIR`: a transformers model from a local directory trains on a mesh like one
process does, from config.json alone or from its weights, and its checkpoint exports to a directory
transformers loads with the same logits. Nothing is downloaded."""

import pytest
import torch

import launch.train as T
from launch.config import load_config
from launch.export import export
from spmd import checkpoint
from tests.test_train import SMALL, _jsonl
from tests.train_ranks import train_on_ranks

pytestmark = pytest.mark.usefixtures("isolated_trainer")

transformers = pytest.importorskip("transformers")


def _tiny_llama_dir(path, weights: bool):
    config = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    if weights:
        torch.manual_seed(7)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return path


def test_config_alone_builds_a_fresh_model_and_the_loss_falls(tmp_path):
    rows = T.train(
        load_config([*SMALL, "--model", f"hf:{_tiny_llama_dir(tmp_path / 'cfg', False)}", "--steps", "12"]), log=False
    )
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0


def test_unknown_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="has no config.json; --model hf:DIR takes a local"):
        T.train(load_config([*SMALL, "--model", f"hf:{tmp_path / 'nowhere'}", "--steps", "1"]), log=False)


@pytest.mark.slow
def test_four_processes_match_one_and_the_export_loads_into_transformers(tmp_path):
    hf_dir = _tiny_llama_dir(tmp_path / "w", True)
    common = [*SMALL, "--model", f"hf:{hf_dir}", "--steps", "4"]
    ref = T.train(load_config(common), log=False)
    ck, m = tmp_path / "ck", tmp_path / "m.jsonl"
    train_on_ranks(4, [*common, "--mesh", "fsdp=2,tp=2,sp", "--ckpt-dir", str(ck), "--metrics", str(m)])
    rows = _jsonl(m)
    for a, b in zip(ref, rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    out = tmp_path / "export"
    export(str(ck), str(out))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    trained = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32)
    step = ck / "step-4"
    with torch.no_grad():
        for name, p in trained.named_parameters():
            p.copy_(checkpoint.read_full(step, "model." + name))
        tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(3))
        torch.testing.assert_close(loaded(tokens).logits, trained(tokens).logits, rtol=0, atol=0)
        assert not torch.equal(
            trained(tokens).logits,
            transformers.AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True, dtype=torch.float32)(
                tokens
            ).logits,
        )  # it did train


def test_explain_plans_an_hf_directory_with_no_implicit_collective(tmp_path):
    """The trainer's model of `hf:DIR` (transformers' Llama, the vocab-parallel loss) on a fake fsdp x tp x sp
    world: the pass decides every collective; DTensor inserts none on its own."""
    import models
    import spmd

    model = models.preset(f"hf:{_tiny_llama_dir(tmp_path / 'cfg', False)}").build()
    plan = spmd.explain(model, spmd.Rules.default(sequence_parallel=True), {"fsdp": 2, "tp": 2}, batch_shape=(4, 32))
    assert plan.comm_bytes() > 0
    assert not [c for c in plan.collectives if c.origin == "implicit"]


def test_init_from_hf_loads_a_directory_into_an_hf_model(tmp_path):
    """`--model hf:B --init-from-hf A` starts from A's weights: its first loss is that of `--model hf:A`
    (bit for bit: the same weights, data and seed), not that of B's own initialisation."""
    weights, fresh = _tiny_llama_dir(tmp_path / "a", True), _tiny_llama_dir(tmp_path / "b", False)
    first = {
        name: T.train(load_config([*SMALL, "--steps", "1", *args]), log=False)[0]["loss"]
        for name, args in {
            "a": ["--model", f"hf:{weights}"],
            "b": ["--model", f"hf:{fresh}"],
            "b from a": ["--model", f"hf:{fresh}", "--init-from-hf", str(weights)],
        }.items()
    }
    assert first["b from a"] == first["a"] and first["b"] != first["a"]


def test_init_from_hf_of_another_architecture_is_a_config_error(tmp_path):
    fresh = _tiny_llama_dir(tmp_path / "b", False)
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4)
    ).save_pretrained(gpt2)
    wider = tmp_path / "wider"
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=320,
            hidden_size=128,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    ).save_pretrained(wider)
    for source, message in [
        (gpt2, "holds a 'gpt2' model but --model hf:.* is 'llama'; pass a directory of the same"),
        (wider, r"do not fit --model hf:.*model\.embed_tokens\.weight \(320, 128\) \(model \(320, 64\)\)"),
        (tmp_path / "none", "needs config.json and \\*.safetensors"),
    ]:
        cfg = load_config([*SMALL, "--model", f"hf:{fresh}", "--init-from-hf", str(source)])
        with pytest.raises(ValueError, match=message):
            cfg.validate(4, cfg.model_config())


def _loads_slices(rank, world, model_dir, weights_dir):
    from safetensors.torch import load_file

    import models
    import spmd
    from launch.hf import load_hf

    model = models.preset(f"hf:{model_dir}").build()
    spmd.parallelize(model, spmd.make_mesh({"fsdp": 2, "tp": 2}), spmd.Rules.default(sequence_parallel=True))
    load_hf(model, weights_dir)
    expected = load_file(f"{weights_dir}/model.safetensors")
    state = checkpoint.model_state(model)
    assert set(state) == set(expected), set(state) ^ set(expected)
    for name, t in state.items():
        assert t.ndim == 1 or any(p.is_shard() for p in t.placements), (name, t.placements)  # slices, not copies
        assert torch.equal(t.full_tensor(), expected[name]), name


def test_init_from_hf_reads_each_ranks_slices_on_fsdp_and_tp(tmp_path):
    """On fsdp=2 x tp=2, `load_hf` fills transformers' model (laid out by the pass) with exactly the
    directory's tensors."""
    from tests.dist_utils import run_distributed

    weights, fresh = _tiny_llama_dir(tmp_path / "a", True), _tiny_llama_dir(tmp_path / "b", False)
    run_distributed(_loads_slices, 4, str(fresh), str(weights), timeout_s=120)


def test_pipeline_parallel_validates_for_hf_models_and_zbv_with_a_tied_head_does_not(tmp_path):
    flags = [*SMALL, "--model", f"hf:{_tiny_llama_dir(tmp_path / 'cfg', False)}", "--mesh", "pp=2,fsdp=2"]
    cfg = load_config(flags)
    cfg.validate(4, cfg.model_config())
    gpt2 = tmp_path / "gpt2"  # GPT-2's head is its embedding: the first and last stage both hold it
    transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=4, n_head=4).save_pretrained(gpt2)
    cfg = load_config(
        [*SMALL, "--model", f"hf:{gpt2}", "--mesh", "pp=2,fsdp=2", "--pp-schedule", "zbv", "--virtual-stages", "2"]
    )
    with pytest.raises(ValueError, match="zbv puts the first and last stage on one rank, which a tied head"):
        cfg.validate(4, cfg.model_config())


def test_attention_dropout_on_a_cpu_mesh_is_a_config_error(tmp_path):
    gpt2 = tmp_path / "gpt2"  # GPT-2's config defaults to attn_pdrop=0.1
    transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4).save_pretrained(gpt2)
    cfg = load_config([*SMALL, "--model", f"hf:{gpt2}", "--mesh", "fsdp=2,tp=2"])
    with pytest.raises(ValueError, match=r"attention dropout \{'attn_pdrop': 0.1\} .*set it to 0.0 in config.json"):
        cfg.validate(4, cfg.model_config())
    load_config([*SMALL, "--model", f"hf:{gpt2}"]).validate(1)  # one process: plain PyTorch applies it


def test_init_from_hf_alone_of_an_unregistered_family_points_to_model_hf(tmp_path):
    from launch.hf import config_from_hf

    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4).save_pretrained(gpt2)
    with pytest.raises(
        ValueError,
        match=rf"no registered model has model_type 'gpt2' .*--model hf:{gpt2}, or "
        rf"--model hf:DIR2 --init-from-hf {gpt2}",
    ):
        config_from_hf(gpt2)


def test_context_parallel_validates_for_hf_models_but_not_with_pp_or_windows(tmp_path):
    """`--model hf:DIR --mesh fsdp=2,cp=2` is a valid run (tests/test_context_parallel.py trains it against one
    process). With pp (the cut stages take no positions) or a model attending within sliding windows (a mask
    the ring does not take) it is a config error naming the fix, and such a model's forward given positions
    raises."""
    hf = ["--model", f"hf:{_tiny_llama_dir(tmp_path / 'cfg', False)}"]
    cfg = load_config([*SMALL, *hf, "--mesh", "fsdp=2,cp=2"])
    cfg.validate(4, cfg.model_config())
    cfg = load_config([*SMALL, *hf, "--mesh", "pp=2,cp=2"])
    with pytest.raises(ValueError, match="pp with cp is not supported for hf: models yet.*use a mesh without pp"):
        cfg.validate(4, cfg.model_config())
    mistral = tmp_path / "mistral"
    transformers.MistralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
    ).save_pretrained(mistral)
    cfg = load_config([*SMALL, "--model", f"hf:{mistral}", "--mesh", "fsdp=2,cp=2"])
    with pytest.raises(ValueError, match=r"attention within windows \{'sliding_window': 32\}.*use a mesh without cp"):
        cfg.validate(4, cfg.model_config())
    cfg = load_config([*SMALL, "--model", f"hf:{mistral}", "--mesh", "fsdp=2,tp=2"])
    cfg.validate(4, cfg.model_config())  # without cp, transformers builds its window mask itself
    model = cfg.model_config().build()  # given positions (the data path under cp), it refuses too
    with pytest.raises(ValueError, match="attention within windows"):
        model(torch.zeros(1, 8, dtype=torch.long), None, torch.arange(8)[None])
