"""Ring attention over the `cp` mesh axis: each rank keeps its queries while K/V blocks (GQA-grouped) travel the ring,
each hop overlapped with the block at hand, partial results merged by log-sum-exp; in backward each block's dK/dV
follows it home. The zigzag split makes every causal step cost every rank the same. torch's context_parallel
dispatches only CUDA kernels, so each block is computed in plain torch, which runs on any device.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...layout.sequence import check_seq_len
from .. import tags
from ..activations import attention_memory

__all__ = ["applies", "cp_active", "ring_attention", "check_sequence_order"]


def applies(q) -> bool:
    """True when `q` ([batch, heads, seq, head_dim]) has its sequence split over an active cp mesh axis."""
    return isinstance(q, DTensor) and _cp_dim(q) == q.ndim - 2


_ELEMENTWISE = {
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.where,
    torch.addcmul,
    torch.lerp,
    torch.Tensor.add,
    torch.Tensor.sub,
    torch.Tensor.mul,
    torch.Tensor.div,
    torch.Tensor.masked_fill,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
    torch.Tensor.__sub__,
    torch.Tensor.__rsub__,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.__truediv__,
    torch.Tensor.__iadd__,
    torch.Tensor.__imul__,
    torch.Tensor.add_,
    torch.Tensor.mul_,
}


def check_sequence_order(func, tensors) -> None:
    """Refuses combining the zigzag-ordered sequence with a tensor the model made along it in natural order (a
    plain sequence-long tensor, or a cp-replicated one aligned in an elementwise op): it would train wrong."""
    split = next(((t, d) for t in tensors if isinstance(t, DTensor) for d in [_cp_dim(t)] if d is not None), None)
    if split is None:
        return
    x, dim = split
    seq = x.shape[dim]
    for t in tensors:
        if t.numel() <= 1 or (isinstance(t, DTensor) and _cp_dim(t) is not None):
            continue
        aligned = dim - (x.ndim - t.ndim)
        if (not isinstance(t, DTensor) and seq in t.shape) or (
            func in _ELEMENTWISE and 0 <= aligned < t.ndim and t.shape[aligned] == seq
        ):
            raise ValueError(
                f"under context parallelism {getattr(func, '__name__', func)} combines the sequence (length {seq}, "
                f"split zigzag over cp) with a tensor of shape {tuple(t.shape)} that runs along it in natural "
                f"order (positions from arange, a mask, a position table sliced to the length), or that a "
                f"view flattening batch and sequence gathered whole (transformers' mixtures of experts, OPT): "
                f"the result would be silently wrong. Pass the positions of the data path (the model's "
                f"forward(..., positions), as spmd.cp_slice gives them), attend through "
                f"F.scaled_dot_product_attention with is_causal, or train this model without a cp axis"
            )


def cp_active(mesh) -> bool:
    names = mesh.mesh_dim_names or ()
    return "cp" in names and mesh.size(names.index("cp")) > 1


def _cp_dim(t: DTensor) -> int | None:
    if not cp_active(t.device_mesh):
        return None
    p = t.placements[t.device_mesh.mesh_dim_names.index("cp")]
    return p.dim if p.is_shard() else None


def ring_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` on DTensors whose sequence dim is split zigzag over cp."""
    problem = (
        "an attention mask"
        if attn_mask is not None
        else "dropout"
        if dropout_p
        else "a query of another head count than K/V without enable_gqa"
        if query.shape[1] != key.shape[1] and not enable_gqa
        else None
    )
    if problem:
        raise ValueError(
            f"ring attention over cp takes no {problem}: use is_causal=True or a full mask "
            f"without dropout, or a mesh without cp"
        )
    if key.placements != query.placements or value.placements != query.placements:
        raise ValueError(
            f"ring attention over cp needs q, k and v in one layout, got {query.placements}, "
            f"{key.placements}, {value.placements}"
        )
    mesh = query.device_mesh
    group = mesh.get_group("cp")
    check_seq_len(query.shape[2], group.size())
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out = _Ring.apply(
        query.to_local(), key.to_local(), value.to_local(), is_causal, scale, group, tags.current_module()
    )
    return DTensor.from_local(out, mesh, query.placements, run_check=False)


def _block(me: int, src: int, t: int, causal: bool):
    """(query rows, key columns, causal) of the attention rank `me` computes on rank `src`'s K/V block."""
    every = slice(0, t)
    if not causal or src == me:
        return every, every, causal
    return (every, slice(0, t // 2), False) if src < me else (slice(t // 2, t), every, False)


def _scores(q, k, causal: bool, scale: float):
    """Scaled, masked fp32 scores of one block: the ring's largest allocation, so later steps work on it in place."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q.float(), k.float()).mul_(scale)
    if causal:
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _attend(q, k, v, causal: bool, scale: float):
    """q [b, hkv, g, tq, d] on one block k, v [b, hkv, tk, d]: (out, lse [b, hkv, g, tq]) in fp32."""
    s = _scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    return torch.einsum("bhgqk,bhkd->bhgqd", s.sub_(lse[..., None]).exp_(), v.float()), lse


def _attend_backward(q, k, v, dout, delta, lse, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of one block, given the merged output's lse and delta = rowsum(dout * out)."""
    p = _scores(q, k, causal, scale).sub_(lse[..., None]).exp_()
    dv = torch.einsum("bhgqk,bhgqd->bhkd", p, dout)
    ds = torch.einsum("bhgqd,bhkd->bhgqk", dout, v.float()).sub_(delta[..., None]).mul_(p).mul_(scale)
    del p
    return torch.einsum("bhgqk,bhkd->bhgqd", ds, k.float()), torch.einsum("bhgqk,bhgqd->bhkd", ds, q.float()), dv


def _exchange(t: torch.Tensor, group, module: str, why: str, tag: int = 0):
    """(buffer, requests) of `t` to the next ring rank, the previous one's received; `tag` keeps K/V and dK/dV apart."""
    n, me = group.size(), group.rank()
    recv = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t, dist.get_global_rank(group, (me + 1) % n), group, tag),
        dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, (me - 1) % n), group, tag),
    ]
    with tags.reason(module, why):
        return recv, dist.batch_isend_irecv(ops)


def _wait(pending):
    recv, requests = pending
    for r in requests:
        r.wait()
    return recv


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, module):
        n, me, t = group.size(), group.rank(), q.shape[2]
        qg = q.unflatten(1, (k.shape[1], -1))  # [b, hkv, g, t, d]
        out = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(n):
            pending = _exchange(kv, group, module, "ring attention: K/V to the next cp rank") if step < n - 1 else None
            rows, cols, blk_causal = _block(me, (me - step) % n, t, causal)
            o, l = _attend(qg[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], blk_causal, scale)
            merged = torch.logaddexp(lse[..., rows], l)
            out[..., rows, :] = (
                out[..., rows, :] * (lse[..., rows] - merged).exp()[..., None] + o * (l - merged).exp()[..., None]
            )
            lse[..., rows] = merged
            if pending is not None:
                kv = _wait(pending)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.group, ctx.module = causal, scale, group, module
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        return attention_memory.attending(_Ring.ring_backward, ctx, grad)

    @staticmethod
    def ring_backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, module = ctx.group, ctx.module
        n, me, t = group.size(), group.rank(), q.shape[2]
        qg, dout = q.unflatten(1, (k.shape[1], -1)), grad.unflatten(1, (k.shape[1], -1)).float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        kv, arriving, own = torch.stack([k, v]), None, None
        for step in range(n):
            pending = (
                _exchange(kv, group, module, "ring attention backward: K/V to the next cp rank")
                if step < n - 1
                else None
            )
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            rows, cols, blk_causal = _block(me, (me - step) % n, t, ctx.causal)
            dq_b, dk_b, dv_b = _attend_backward(
                qg[..., rows, :],
                kv[0][..., cols, :],
                kv[1][..., cols, :],
                dout[..., rows, :],
                delta[..., rows],
                lse[..., rows],
                blk_causal,
                ctx.scale,
            )
            dq[..., rows, :] += dq_b
            dkv[0][..., cols, :] += dk_b
            dkv[1][..., cols, :] += dv_b
            if step == 0:
                own = dkv
            else:
                # the block's accumulator follows it to the next rank; after the last step, to its owner
                total = dkv if arriving is None else dkv + arriving.float()
                arriving = _wait(
                    _exchange(
                        total.to(k.dtype), group, module, "ring attention backward: dK/dV to the next cp rank", tag=1
                    )
                )
            if pending is not None:
                kv = _wait(pending)
        if arriving is not None:
            own = own + arriving.float()
        return dq.reshape(q.shape).to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None
