"""Vocab-parallel cross-entropy on gloo CPU process groups against single-process F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import kernels
from spmd.layout.mesh import flatten_groups

IGNORE = -100


def _problem(n: int, vocab: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(n * 1000 + vocab)
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[::5] = IGNORE
    targets[1] = vocab - 1  # the last vocab entry sits in the last rank's (shorter) shard
    return logits, targets


def _check(mesh, logits_pl, targets_pl, n, vocab, dtype=torch.float32, n_all_reduce=None, column_major=False):
    """`column_major`: the logits' local tensor is laid out transposed, so its gradient's strides differ."""
    logits, targets = _problem(n, vocab, dtype)
    ref_logits = logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.float(), targets, ignore_index=IGNORE)
    ref.backward()

    d_logits = distribute_tensor(logits, mesh, logits_pl, src_data_rank=None)
    if column_major:
        local = d_logits.to_local().t().contiguous().t()
        d_logits = DTensor.from_local(local, mesh, logits_pl, run_check=False, shape=d_logits.shape, stride=(1, n))
        assert not d_logits.to_local().is_contiguous()
    d_logits = d_logits.detach().requires_grad_()
    d_targets = targets if targets_pl is None else distribute_tensor(targets, mesh, targets_pl, src_data_rank=None)
    with CommDebugMode() as comm:
        loss = kernels.cross_entropy(d_logits, d_targets, ignore_index=IGNORE)
        loss.backward()

    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    assert not any("gather" in k for k in counts), counts
    if n_all_reduce is not None:
        assert sum(v for k, v in counts.items() if "all_reduce" in k) == n_all_reduce, counts

    assert isinstance(loss, DTensor) and loss.ndim == 0
    assert all(isinstance(p, Replicate) for p in loss.placements)
    torch.testing.assert_close(loss.to_local(), ref.detach(), rtol=1e-6, atol=0)
    want_grad = distribute_tensor(ref_logits.grad, mesh, logits_pl, src_data_rank=None).to_local()
    got_grad = d_logits.grad.to_local()
    assert got_grad.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-9)
    else:  # the gradient is computed in fp32 and rounded once to bf16, as the reference does
        torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)


def _check_linear(mesh):
    """linear_cross_entropy on DTensors: a vocab-sharded output head gives vocab-sharded logits."""
    gen = torch.Generator().manual_seed(7)
    hidden, weight = torch.randn(12, 8, generator=gen), torch.randn(45, 8, generator=gen)
    _, targets = _problem(12, 45)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w_ref.t(), targets, ignore_index=IGNORE)
    ref.backward()
    h = distribute_tensor(hidden, mesh, [Replicate()], src_data_rank=None).requires_grad_()
    w = distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None).requires_grad_()
    with CommDebugMode() as comm:
        loss = kernels.linear_cross_entropy(h, w, distribute_tensor(targets, mesh, [Replicate()], src_data_rank=None))
    assert not any("gather" in str(k) for k in comm.get_comm_counts()), comm.get_comm_counts()
    loss.backward()
    torch.testing.assert_close(loss.to_local(), ref.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(h.grad.full_tensor(), h_ref.grad, rtol=1e-5, atol=1e-7)


def _tp2(rank, world):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    # vocab 103 splits 52 / 51; forward: max + (sum_exp, target logit); backward: nothing
    _check(mesh, [Shard(1)], [Replicate()], n=24, vocab=103, n_all_reduce=2)
    _check(mesh, [Shard(1)], None, n=7, vocab=37)  # plain global targets
    _check(mesh, [Shard(1)], [Replicate()], n=16, vocab=61, dtype=torch.bfloat16)
    _check(mesh, [Shard(0)], [Shard(0)], n=10, vocab=29, n_all_reduce=1)  # data parallel only: torch's fused CE
    _check(mesh, [Shard(0)], [Shard(0)], n=10, vocab=29, dtype=torch.bfloat16, n_all_reduce=1)
    _check(mesh, [Shard(1)], [Replicate()], n=24, vocab=103, column_major=True)
    _check(mesh, [Shard(0)], [Shard(0)], n=10, vocab=29, column_major=True)
    _check_linear(mesh)
    partial = DTensor.from_local(torch.randn(4, 8), mesh, [Partial()], run_check=False)
    with pytest.raises(ValueError, match="Partial"):
        kernels.cross_entropy(partial, torch.zeros(4, dtype=torch.long))


def _dp2_tp2(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    # tokens 22 -> 11 per dp rank, vocab 101 -> 51 / 50 per tp rank; + one all-reduce of (loss sum, count)
    _check(mesh, [Shard(0), Shard(1)], [Shard(0), Replicate()], n=22, vocab=101, n_all_reduce=3)
    _check(mesh, [Shard(0), Shard(1)], [Replicate(), Replicate()], n=13, vocab=47)  # targets sliced locally
    _check(mesh, [Replicate(), Shard(1)], [Replicate(), Replicate()], n=9, vocab=31, n_all_reduce=2)
    # vocab over both mesh dims: 43 -> 22 / 21 -> 11, 11 / 11, 10; two all-reduces per vocab dim
    _check(mesh, [Shard(1), Shard(1)], [Replicate(), Replicate()], n=6, vocab=43, n_all_reduce=4)
    # once the mesh has the flattened dp x tp group (spmd.parallelize makes it), the max and the sums are one
    # all-reduce each over it, and so is (loss sum, count) for tokens split over both dims
    flatten_groups(mesh, ("dp", "tp"))
    _check(mesh, [Shard(1), Shard(1)], [Replicate(), Replicate()], n=6, vocab=43, n_all_reduce=2)
    _check(mesh, [Shard(0), Shard(0)], [Shard(0), Shard(0)], n=12, vocab=29, n_all_reduce=1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_vocab_parallel_ce_tp2():
    run_distributed(_tp2, 2, timeout_s=150)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_vocab_parallel_ce_dp2_tp2():
    run_distributed(_dp2_tp2, 4, timeout_s=200)
