"""Vocab-parallel cross-entropy on DTensor logits, as Megatron does it: the logits are never gathered.

Logits are [N, V] (or [B, T, V]) on a mesh whose dims place them on a token dim, on the vocab (last) dim, or
Replicate: under context parallelism the sequence dim of [B, T, V] stays split, and so the loss sums over
every rank's tokens without gathering them either.
Over the vocab-sharding mesh dims we all-reduce the row max, then the row sum of exp together with the
target logit (taken on the rank whose vocab range holds the target); over the token-sharding dims we
all-reduce the loss sum and the count of non-ignored tokens. The backward (softmax minus one-hot, over
the local vocab slice) needs no communication. Logits with the whole vocab on every rank take torch's fused
cross-entropy on the local tokens and the one all-reduce over the token dims.
"""

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info


def _all_reduce(t: torch.Tensor, op: str, groups) -> torch.Tensor:
    for group in groups:
        t = funcol.wait_tensor(funcol.all_reduce(t, op, group))
    return t


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, ignore_index, vocab_groups, token_groups):
        x = logits.float()
        v_local = x.shape[1]
        row_max = _all_reduce(x.max(dim=1).values, "max", vocab_groups)
        sum_exp = torch.exp(x - row_max[:, None]).sum(dim=1)

        valid = targets != ignore_index
        local_t = targets - vocab_start
        mine = valid & (local_t >= 0) & (local_t < v_local)
        picked = x.gather(1, local_t.clamp(0, v_local - 1)[:, None]).squeeze(1)
        target_logit = torch.where(mine, picked, torch.zeros_like(picked))
        sum_exp, target_logit = _all_reduce(torch.stack([sum_exp, target_logit]), "sum", vocab_groups)

        per_token = torch.where(valid, torch.log(sum_exp) + row_max - target_logit, torch.zeros_like(sum_exp))
        loss_sum, count = _all_reduce(torch.stack([per_token.sum(), valid.sum().float()]), "sum", token_groups)

        ctx.save_for_backward(logits, row_max, sum_exp, local_t, mine, valid, count)
        return loss_sum / count

    @staticmethod
    def backward(ctx, grad):
        logits, row_max, sum_exp, local_t, mine, valid, count = ctx.saved_tensors
        g = torch.exp(logits.float() - row_max[:, None]) / sum_exp[:, None]
        # minus one-hot on the rank that holds the target (no data-dependent shapes: runs on fake tensors)
        g.scatter_add_(1, local_t.clamp(0, g.shape[1] - 1)[:, None], -mine.to(g.dtype)[:, None])
        g *= (valid.float() * (grad / count))[:, None]
        return g.to(logits.dtype), None, None, None, None, None


def _token_parallel_ce(logits, targets, ignore_index: int, token_groups) -> torch.Tensor:
    """Logits whose vocab is whole on every rank: torch's fused cross-entropy on the local tokens, then one
    all-reduce of (loss sum, count). The value is the global mean; each rank's gradient is its own tokens'
    share, d(local sum) / global count, as the vocab-parallel backward gives it."""
    if not token_groups:  # every token on this rank: torch's mean over the non-ignored ones
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
    loss_sum = F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum().float()
    total_sum, total_count = _all_reduce(torch.stack([loss_sum.detach(), count]), "sum", token_groups)
    return (loss_sum + (total_sum - loss_sum.detach())) / total_count


def _placement_dims(logits: DTensor):
    vocab_dims, token_dims = [], []
    for mesh_dim, p in enumerate(logits.placements):
        if isinstance(p, Replicate):
            continue
        if type(p) is Shard and p.dim == logits.ndim - 1:
            vocab_dims.append(mesh_dim)
        elif type(p) is Shard:
            token_dims.append(mesh_dim)
        else:
            raise ValueError(
                f"vocab-parallel cross-entropy takes logits placed Shard(dim) or Replicate on each mesh "
                f"dim; got {p} on mesh dim {mesh_dim} ({logits.placements}). Redistribute Partial logits first."
            )
    return vocab_dims, token_dims


def _groups(mesh, dims) -> list:
    """The process groups a sum over mesh dims `dims` runs in: the one group that flattens them where the mesh
    has it (spmd.parallelize makes those of the axes that split tokens), so the sum is one collective, else
    one per dim. Dims of size 1 sum nothing."""
    dims = [d for d in dims if mesh.size(d) > 1]
    if len(dims) > 1 and mesh.mesh_dim_names:
        flat = mesh._get_root_mesh()._flatten_mapping.get("_".join(mesh.mesh_dim_names[d] for d in dims))
        if flat is not None:
            return [flat.get_group()]
    return [mesh.get_group(d) for d in dims]


def _local_targets(targets, logits: DTensor, token_dims) -> torch.Tensor:
    mesh = logits.device_mesh
    want = [logits.placements[d] if d in token_dims else Replicate() for d in range(mesh.ndim)]
    if not isinstance(targets, DTensor):
        # a plain tensor is taken to be the global targets, identical on every rank
        targets = DTensor.from_local(targets, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if targets.device_mesh != mesh:
        raise ValueError("targets and logits must live on the same device mesh")
    if any(p.is_partial() for p in targets.placements):
        raise ValueError(f"targets must not be Partial, got {targets.placements}")
    if list(targets.placements) != want:
        targets = targets.redistribute(mesh, want)  # [N] integers: cheap, and usually only a local slice
    return targets._local_tensor  # (integers: no gradient to carry back)


def _vocab_start(vocab: int, mesh, vocab_dims) -> int:
    """First global vocab index of this rank's slice. Shards split like torch.chunk (the last ones may be
    shorter), mesh dims in order; plain integers, so this also runs under fake tensors."""
    coords = mesh.get_coordinate()
    start, size = 0, vocab
    for d in vocab_dims:
        chunk = -(-size // mesh.size(d))
        offset = min(coords[d] * chunk, size)
        start, size = start + offset, max(0, min(chunk, size - offset))
    return start


def vocab_parallel_cross_entropy(logits: DTensor, targets, ignore_index: int = -100) -> DTensor:
    """Mean cross-entropy over non-ignored tokens of [..., V] DTensor logits against [...] targets; a 0-dim
    all-Replicate DTensor."""
    if logits.ndim < 2:
        raise ValueError(f"logits must be [N, V] or [B, T, V], got shape {tuple(logits.shape)}")
    if any(p.is_partial() for p in logits.placements):
        raise ValueError(
            f"vocab-parallel cross-entropy cannot take Partial logits ({logits.placements}); "
            "reduce them first, e.g. logits.redistribute(mesh, [Shard(1)])"
        )
    # the body runs on local tensors and DTensor's own dispatch, with torch-function modes off: a mode above
    # (a framework's view of the model) has nothing to do here, and under one every op costs about twice
    with torch._C.DisableTorchFunction():
        return _loss(logits, targets, ignore_index)


def _loss(logits: DTensor, targets, ignore_index: int) -> DTensor:
    vocab_dims, token_dims = _placement_dims(logits)
    mesh = logits.device_mesh
    local_logits = _Local.apply(logits).flatten(0, -2)
    local_targets = _local_targets(targets, logits, token_dims).flatten()
    if vocab_dims:
        loss = _VocabParallelCE.apply(
            local_logits,
            local_targets,
            _vocab_start(logits.shape[-1], mesh, vocab_dims),
            ignore_index,
            _groups(mesh, vocab_dims),
            _groups(mesh, token_dims),
        )
    else:
        loss = _token_parallel_ce(local_logits, local_targets, ignore_index, _groups(mesh, token_dims))
    return _Replicated.apply(loss, mesh)


# The loss's two edges run once per step, on every rank. DTensor's to_local and from_local build a DTensorSpec
# for the gradient and for the loss at each call, several times the loss's own cost at a small batch; these
# reuse the logits' spec and one spec per mesh for the scalar.


class _Local(torch.autograd.Function):
    """`x.to_local()`: its gradient comes back in `x`'s layout (its spec, when the strides agree)."""

    @staticmethod
    def forward(ctx, x: DTensor):
        local = x._local_tensor
        ctx.spec, ctx.local_stride = x._spec, local.stride()
        ctx.set_materialize_grads(False)
        return local.view_as(local)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None
        spec = ctx.spec
        if g.stride() != ctx.local_stride:
            return DTensor.from_local(
                g,
                spec.mesh,
                spec.placements,
                run_check=False,
                shape=spec.shape,
                stride=tuple(compute_global_tensor_info(g, spec.mesh, spec.placements)[1]),
            )
        return DTensor.__new__(DTensor, g, spec, requires_grad=False)


_SCALAR_SPECS: dict = {}  # (id(mesh), dtype) -> (mesh, the spec of a 0-dim tensor replicated on it)


class _Replicated(torch.autograd.Function):
    """`DTensor.from_local(loss, mesh, [Replicate()] * mesh.ndim)` of a 0-dim loss equal on every rank."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, mesh):
        key = (id(mesh), loss.dtype)
        hit = _SCALAR_SPECS.get(key)
        if hit is None or hit[0] is not mesh:
            hit = _SCALAR_SPECS[key] = (
                mesh,
                DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tensor_meta=TensorMeta(torch.Size(()), (), loss.dtype)),
            )
        return DTensor.__new__(DTensor, loss.view_as(loss), hit[1], requires_grad=loss.requires_grad)

    @staticmethod
    def backward(ctx, g):
        if not all(p.is_replicate() for p in g.placements):
            g = g.redistribute(placements=[Replicate()] * g.device_mesh.ndim)
        return g._local_tensor, None
