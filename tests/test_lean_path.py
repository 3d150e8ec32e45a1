"""What the runtime leaves out where nothing moves: the pass's hooks inside blocks that run on local tensors
(put back when such a block takes the DTensor path), DTensor's dispatch of `detach` (kept where the
compiler traces one), and layout decisions already made for the same shape. Checked against the plain
model's gradients, and compiled blocks against a failure of the compiler's partitioner that a traced
shortcut caused."""

import math

import torch
from torch.distributed.tensor import DTensor, Shard

import spmd
from tests.dist_utils import run_distributed
from tests.spmd_cases import global_batch, local_slice, norm_rel_err, tiny_model


def _pass_hooks(m) -> int:
    """How many of the pass's hooks `m` carries (its pre- and post-hook, both or neither)."""
    ours = getattr(m, "_spmd_hooks", None)
    if ours is None:
        return 0
    return sum(h is ours[0] for h in m._forward_pre_hooks.values()) + sum(
        h is ours[1] for h in m._forward_hooks.values()
    )


def _grads_match_plain(model, tokens, targets, mesh, plain=None):
    plain = tiny_model() if plain is None else plain
    plain(tokens, targets).backward()
    model(local_slice(tokens, mesh), local_slice(targets, mesh)).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert norm_rel_err(p.grad.full_tensor(), q.grad) <= 1e-5, name


def _hooks_inside_local_blocks(rank, world):
    mesh = spmd.make_mesh({"dp": 2})
    tokens, targets = global_batch(0)
    seen = []
    model = tiny_model()
    mine = model.layers[0].attention.wq
    mine.register_forward_pre_hook(lambda m, args: seen.append(type(args[0])))  # registered before parallelize
    spmd.parallelize(model, mesh, spmd.Rules.default())
    inside = [m for block in model.layers for m in list(block.modules())[1:] if m is not mine]
    assert all(_pass_hooks(block) == 2 for block in model.layers) and _pass_hooks(model) == 2
    assert all(_pass_hooks(m) == 0 and not m._forward_pre_hooks for m in inside)
    # a module with a hook of its own keeps the pass's, in the order registered
    assert _pass_hooks(mine) == 2 and list(mine._forward_pre_hooks.values())[1] is mine._spmd_hooks[0]
    _grads_match_plain(model, tokens, targets, mesh)
    assert seen == [torch.Tensor]  # inside the block, the user's hook sees local tensors

    # activation checkpointing sends the blocks down the DTensor path: the hooks inside come back at the first
    # forward, ahead of a hook registered since, and the gradients still equal the plain model's
    model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default())
    later = model.layers[1].feed_forward.w1
    later.register_forward_pre_hook(lambda m, args: seen.append(type(args[0])))
    spmd.apply_activation_checkpointing(model, "full")
    _grads_match_plain(model, tokens, targets, mesh)
    assert all(_pass_hooks(m) == 2 for block in model.layers for m in list(block.modules())[1:])
    assert list(later._forward_pre_hooks.values())[0] is later._spmd_hooks[0]
    assert seen[-1] is DTensor  # the user's hook now runs after the pass's, on the DTensor path


def test_blocks_on_local_tensors_carry_no_hooks_inside_until_they_take_the_dtensor_path():
    run_distributed(_hooks_inside_local_blocks, 2, timeout_s=180)


def _detach(rank, world):
    spmd.runtime.dtensor.install()  # (parallelize installs it; this DTensor is made by hand)
    mesh = spmd.make_mesh({"fsdp": 2})
    full = torch.arange(24.0).reshape(4, 6).requires_grad_()
    x = DTensor.from_local(full[2 * rank : 2 * rank + 2] * 1.0, mesh, [Shard(0)], run_check=False)
    d = x.detach()
    assert isinstance(d, DTensor) and not d.requires_grad and x.requires_grad
    assert d.placements == x.placements and d.shape == x.shape and d.stride() == x.stride()
    assert d._local_tensor.data_ptr() == x._local_tensor.data_ptr()  # a view, as a plain detach is
    assert torch.equal(d.full_tensor(), full.detach())


def test_detach_of_a_dtensor_keeps_its_layout_and_storage():
    run_distributed(_detach, 2, timeout_s=120)


def _eager_and_compiled_losses(compiled: bool) -> tuple[list[float], int]:
    """3 steps of the benchmark's tiny model under full activation checkpointing, its blocks compiled or not;
    (losses, detaches of DTensors with traced local tensors that went through DTensor's own dispatch)."""
    from benchmarks import overhead
    from spmd.runtime.dtensor import detach

    traced = []
    original = detach.dtensor_dispatch

    def counted(op, args, kwargs):
        traced.append(type(args[0]._local_tensor))
        return original(op, args, kwargs)

    detach.dtensor_dispatch = counted
    try:
        cfg, model, opt = overhead.build("tiny", "spmd", "fp32")
        spmd.apply_activation_checkpointing(model, "full")  # checkpointed blocks compile on the DTensor path
        if compiled:
            spmd.compile_blocks(model, backend="aot_eager_decomp_partition")
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, cfg.vocab_size, (8, 128), generator=g) for _ in range(2))
        step = overhead.step_fn(model, opt, x, y, "spmd", "fp32")
        return [step() for _ in range(3)], len(traced)
    finally:
        detach.dtensor_dispatch = original


def _compiled_after_eager_detach(rank, world):
    from benchmarks import overhead

    overhead.dtensor_op_overhead()  # eager DTensor ops on a 1-process mesh, before the compiler traces a detach
    eager, eager_traced = _eager_and_compiled_losses(False)
    compiled, traced = _eager_and_compiled_losses(True)
    assert eager_traced == 0 and traced > 0, (eager_traced, traced)  # the compiler's detaches: DTensor's dispatch
    for a, b in zip(compiled, eager):  # fp32, the compiler fuses and reorders: 1e-5 relative
        assert math.isfinite(a) and abs(a - b) <= 1e-5 * abs(b), (compiled, eager)


def test_compiled_blocks_trace_detach_through_dtensor_dispatch():
    """Every detach the compiler traces (its local tensor fake or functional) goes through DTensor's own
    dispatch, not spmd's eager shortcut, and 3 compiled steps give the eager losses within 1e-5. Kills the
    shortcut taken for traced detaches too (`if False:` for the test of the local tensor's type): the compile
    then fails in the min-cut partitioner ("Node tangents_2 was invalid, but is output"). The blocks compile with
    backend aot_eager_decomp_partition: AOTAutograd's trace, inductor's decompositions and its partitioner (where
    the shortcut fails), without its C++ code generation (a third of the test's time; inductor's code is
    test_compile's inductor test)."""
    run_distributed(_compiled_after_eager_detach, 1, timeout_s=300)


def _layouts_decided_once(rank, world):
    import importlib

    activations, laid_out = (importlib.import_module(f"spmd.runtime.{m}") for m in ("activations.moves", "parallelize"))
    mesh = spmd.make_mesh({"dp": 2})
    model = spmd.parallelize(tiny_model(), mesh, spmd.Rules.default())
    decided = []
    for module in (activations, laid_out):
        original = module.placements_for
        module.placements_for = lambda *a, _f=original, **k: decided.append(a[-1]) or _f(*a, **k)
    tokens, targets = global_batch(0)
    _grads_match_plain(model, tokens, targets, mesh)
    first = len(decided)
    assert first > 0  # the inputs' and each constrain's layouts, decided on the first step
    model.zero_grad(set_to_none=True)
    _grads_match_plain(model, tokens, targets, mesh)
    assert len(decided) == first, decided[first:]  # the same shapes: nothing decided again
    model.zero_grad(set_to_none=True)
    _grads_match_plain(model, tokens[:, :8], targets[:, :8], mesh)
    assert len(decided) > first  # a new sequence length: each constrain decides for its new shape


class _TiedHead(torch.nn.Module):
    """An embedding and an output projection sharing one weight, no repeated blocks: every parameter moves on
    its own, on the DTensor path."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = torch.nn.Embedding(512, 16), torch.nn.Linear(16, 512, bias=False)
        self.head.weight = self.embed.weight
        spmd.annotate(self.embed.weight, "vocab", "embed")

    def forward(self, tokens, targets):
        logits = self.head(self.embed(tokens))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _groups_of_one_made_once(rank, world):
    """A tied weight under fsdp=2 is a group of one, gathered once per forward for both modules and regathered
    for each in backward: on the local path (the tiny Llama's root unit) and on the DTensor path (no blocks)."""
    from spmd.runtime.parameters import group

    mesh = spmd.make_mesh({"fsdp": 2})
    made, init = [], group.ParamGroup.__init__
    group.ParamGroup.__init__ = lambda self, name, *a, **k: made.append(name) or init(self, name, *a, **k)
    try:
        for build, name in (
            (lambda: tiny_model(tie_embeddings=True), "tok_embeddings.weight"),
            (_TiedHead, "embed.weight"),
        ):
            model = spmd.parallelize(build(), mesh, spmd.Rules.default())
            del made[:]  # the flat groups parallelize makes
            counts = []
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                _grads_match_plain(model, *global_batch(0), mesh, plain=build())
                counts.append(len(made))
            assert made == [name] and counts == [1, 1, 1], (made, counts)
    finally:
        group.ParamGroup.__init__ = init


def _made_once(rank, world):
    _layouts_decided_once(rank, world)
    _groups_of_one_made_once(rank, world)


def test_layout_decisions_are_made_once_per_shape():
    """The layouts of the model's inputs and of each `constrain` follow from the rules and the shape: decided
    on the first step, reused on the next (no per-step Python work that does not change between steps). So is
    a parameter's group of one: a tied weight's gather and its regathers for each module share one group, made
    on its first move (gradients equal the plain model's within 1e-5). Mutation: `regathering_group` making a
    fresh group of one per call makes 3 groups on the first step and 2 on each later one (DTensor path)."""
    run_distributed(_made_once, 2, timeout_s=180)


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ops by name, and the shapes of the tensors cast (`_to_copy`)."""

    def __init__(self):
        super().__init__()
        self.seen, self.cast = {}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.seen[name] = self.seen.get(name, 0) + 1
        if name == "_to_copy":
            self.cast.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def _mixed_precision_casts(rank, world):
    import copy

    mesh = spmd.make_mesh({"fsdp": 2})
    tokens, targets = global_batch(0)
    plain = tiny_model()
    low = copy.deepcopy(plain).to(torch.bfloat16)  # the model in the compute dtype, on one device
    low(tokens, targets).backward()
    model = spmd.parallelize(plain, mesh, spmd.Rules.default(), param_dtype=torch.bfloat16)  # reduce_dtype fp32
    with _CountOps() as ours:
        model(local_slice(tokens, mesh), local_slice(targets, mesh)).backward()
    assert len(model._spmd_state.groups) == 3  # the root unit and two blocks
    # the parameters go to bf16 before their all-gather, the gradients to fp32 before their reduce-scatter: one
    # foreach copy per bucket each way, and one more per block for ZeRO-3's regather in backward
    assert ours.seen.get("_foreach_copy_") == 2 * 3 + 2
    shapes = {tuple(t.shape) for p in model.parameters() for t in (p, p._local_tensor)}
    assert not shapes & set(ours.cast), sorted(shapes & set(ours.cast))  # no parameter cast one at a time
    for (name, p), q in zip(model.named_parameters(), low.parameters()):
        # each rank's bf16 gradients of half the batch summed in fp32, against the whole batch's in bf16 buffers
        # on one device: apart by bf16's resolution (2^-8 relative), not by a parameter's whole gradient
        assert p.dtype == torch.float32 and norm_rel_err(p.grad.full_tensor(), q.grad.float()) <= 2e-2, name


def test_mixed_precision_casts_each_bucket_in_one_copy_each_way():
    """param_dtype=bf16: a block's parameters are cast to bf16 in one foreach copy into one buffer, and its
    gradients back to fp32 in another (on a GPU each per-parameter cast was a kernel launch of its own); the
    gradients land on the right parameters."""
    run_distributed(_mixed_precision_casts, 2, timeout_s=180)
