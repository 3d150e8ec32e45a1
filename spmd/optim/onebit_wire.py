"""The 1-bit compressed all-reduce of 1-bit Adam (Tang et al. 2021): N workers each hold a vector, every
worker ends with (a compression of) their average, and about 1/32 of fp32's bytes cross the wire.

Each vector is zero-padded to a multiple of 8*N elements and cut into N equal chunks; worker r is the
"server" of chunk r. One compression C turns a chunk x into sign(x) (packed 8 per byte, +1 where x >= 0)
and one fp32 scale, mean(|x|) (the scale that minimises ||x - s*sign(x)||_2):

    worker i:  y = x_i + e_i;   send C(y's chunk r) to worker r;   e_i <- y - C(y)       (worker error)
    server r:  z = 1/N sum_i C(y_i's chunk r) + s_r;   s_r <- z - C(z)                   (server error)
               every worker gets C(z) of every chunk

`exchange` does this for a list of vectors (a model's parameters) in two collectives over the default group:
one all-to-all of the workers' compressed chunks and one all-gather of the servers' results, each row
holding every vector's sign bytes then every vector's scale. Bytes each rank puts on the wire per exchange
(`wire_bytes`, the recorder's ring convention): 2*(N-1)*(sum_v padded_v/(8N) + 4*V) for V vectors, against
2*(N-1)/N*4*sum_v numel_v for an fp32 all-reduce.
"""

import torch
import torch.distributed as dist

__all__ = ["padded_numel", "compress", "decompress", "pack_signs", "unpack_signs", "exchange", "wire_bytes"]

_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def padded_numel(numel: int, world: int) -> int:
    """`numel` rounded up to a multiple of 8*world: N chunks of whole bytes of sign bits."""
    unit = 8 * world
    return -(-numel // unit) * unit


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/8] from x [..., n]: bit 1 where x >= 0, most significant bit first."""
    bits = (x >= 0).to(torch.uint8).unflatten(-1, (-1, 8))
    return (bits << _SHIFTS.to(x.device)).sum(-1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """+1/-1 [..., 8*n] from the uint8 [..., n] of pack_signs."""
    bits = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 1
    return bits.flatten(-2).to(dtype) * 2 - 1


def compress(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed signs [R, c/8], scales [R]) of each row of `rows` [R, c]: C(x) = mean(|x|) * sign(x)."""
    return pack_signs(rows), rows.abs().mean(-1)


def decompress(signs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return unpack_signs(signs) * scales.unsqueeze(-1)


def exchange(vectors, worker_errors, server_errors, world: int) -> list[torch.Tensor]:
    """The compressed average of every worker's `vectors` (fp32, each padded: N*c elements), updating this
    worker's `worker_errors` (same shapes) and `server_errors` (c elements each: this rank's chunk) in place.
    Collective over the default group of `world` (N) ranks; runs without communication when N is 1."""
    sent = []
    for x, e in zip(vectors, worker_errors):
        y = (x + e).view(world, -1)
        sent.append(compress(y))
        e.copy_((y - decompress(*sent[-1])).view(-1))
    received = _all_to_all(sent, world)
    served = []
    for (signs, scales), s in zip(received, server_errors):
        z = _average([decompress(signs[i], scales[i]) for i in range(world)]) + s
        served.append(compress(z.unsqueeze(0)))
        s.copy_(z - decompress(*served[-1]).squeeze(0))
    return [decompress(signs, scales).view(-1) for signs, scales in _all_gather(served, world)]


def _average(decompressed: list[torch.Tensor]) -> torch.Tensor:
    total = decompressed[0].clone()
    for d in decompressed[1:]:
        total += d
    return total / len(decompressed)


def _rows(pairs, world: int) -> torch.Tensor:
    """uint8 [world, B]: row r holds, for every vector, its row r of signs then its row r of scales."""
    signs = [s for s, _ in pairs]
    scales = torch.stack([sc for _, sc in pairs], dim=1).contiguous()  # [world, V] fp32
    return torch.cat(signs + [scales.view(torch.uint8)], dim=1)


def _split(rows: torch.Tensor, widths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The inverse of `_rows`: [(signs [world, c/8], scales [world])] per vector of `widths` sign bytes."""
    at = sum(widths)
    scales = rows[:, at:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # 4-byte aligned
    out, start = [], 0
    for v, w in enumerate(widths):
        out.append((rows[:, start : start + w], scales[:, v]))
        start += w
    return out


def _all_to_all(sent, world: int):
    send = _rows(sent, world)
    recv = torch.empty_like(send)
    if world > 1:
        dist.all_to_all_single(recv, send)
    else:
        recv.copy_(send)
    return _split(recv, [signs.shape[1] for signs, _ in sent])


def _all_gather(served, world: int):
    mine = _rows(served, 1)
    out = mine.new_empty(world, mine.shape[1])
    if world > 1:
        dist.all_gather_single(out, mine)
    else:
        out.copy_(mine)
    return _split(out, [signs.shape[1] for signs, _ in served])


def wire_bytes(numels, world: int) -> int:
    """Bytes one rank sends per exchange of vectors of `numels` elements over `world` ranks (module docstring)."""
    if world <= 1:
        return 0
    row = sum(padded_numel(n, world) // (8 * world) for n in numels) + 4 * len(numels)
    return 2 * (world - 1) * row
