"""A collective's sum as the network does it: element by element along a ring of the group's ranks,
the running sum rounded to the tensor's dtype at every hop (in bf16 a reduction over 512 ranks rounds
511 times), not once as torch.sum does.

The order is gloo's, found element by element against its collectives on this torch and checked bit
for bit in tests/test_ring.py:
- the buffer of L elements is cut into n chunks of ceil(L / n) elements rounded up to even (the last
  ones short or empty);
- chunk c is summed over the group's ranks c - 1, c - 2, ..., c (mod n): its sum ends at rank c;
- a reduce-scatter is that all-reduce of the whole buffer, each rank keeping its piece (so with an odd
  piece size the chunks straddle the pieces);
- an average (ReduceOp.AVG, or SUM and then a division, as fldp.transport) divides the sum once.

NCCL, which the paper ran, also sums each element along a ring of the ranks in the dtype, rounding at
every hop, but it cuts the buffer by channel, loop and slice, so which rank ends which element's sum
differs, and between nodes it may run its all-reduce as a tree (NCCL_ALGO), which rounds log2(n)
times instead of n - 1. This model is gloo's ring, not NCCL's.
"""

from __future__ import annotations

import math

import torch

from .mesh import shard_piece


def gloo_chunk(length: int, ranks: int) -> int:
    """The elements of each of gloo's ring chunks: ceil(length / ranks) rounded up to even."""
    return 2 * math.ceil(math.ceil(length / ranks) / 2)


def ring_sum(terms: torch.Tensor) -> torch.Tensor:
    """terms [..., n, L], rank i's buffer at [..., i, :]: the all-reduce's sum [..., L], each element
    summed in its chunk's ring order and rounded to terms.dtype after every addition."""
    ranks, length = terms.shape[-2], terms.shape[-1]
    if ranks == 1:
        return terms[..., 0, :].clone()
    chunk = gloo_chunk(length, ranks)
    # [..., rank, chunk c, its elements]; chunks past the buffer's end are padding, summed and dropped
    pieces = torch.nn.functional.pad(terms, (0, ranks * chunk - length)).unflatten(-1, (ranks, chunk))
    total = torch.empty_like(pieces[..., 0, :, :])
    for hop in range(ranks):
        # chunk c's term at this hop is rank (c - 1 - hop) mod n's: two diagonals of [rank, chunk],
        # views (chunks hop+1.. from ranks 0.., chunks ..hop from the wrapped-around ranks)
        for first, diagonal in ((hop + 1, hop + 1), (0, hop + 1 - ranks)):
            view = pieces.diagonal(diagonal, dim1=-3, dim2=-2).movedim(-1, -2)
            target = total[..., first : first + view.shape[-2], :]
            target.copy_(view) if hop == 0 else target.add_(view)
    return total.flatten(-2)[..., :length]


def ring_mean(terms: torch.Tensor) -> torch.Tensor:
    """The average over the n ranks of terms [..., n, L]: ring_sum, then one division (AVG)."""
    total = ring_sum(terms)
    return total.div_(terms.shape[-2]) if terms.shape[-2] > 1 else total


def _padded(grad: torch.Tensor, replicas: int, shards: int) -> torch.Tensor:
    """A parameter's per-rank gradients [F, R*S, rows, ...] as FSDP2 copies them into its
    reduce-scatter buffer: dim 0 padded to S pieces of ceil(rows / S) rows, [F, R, source, piece, numel]."""
    groups, rows = grad.shape[0], grad.shape[2]
    piece = shard_piece(rows, shards)
    flat = grad.reshape(groups, replicas, shards, rows, -1)
    if piece * shards != rows:
        flat = torch.nn.functional.pad(flat, (0, 0, 0, piece * shards - rows))
    return flat.reshape(groups, replicas, shards, shards, -1)


def fsdp_unit_mean(
    grads: list[torch.Tensor], replicas: int, shards: int, reduce_dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """What FSDP2 on gloo leaves of one unit's gradients: grads[i] [F, R*S, *shape] (rank r * S + s
    of each of F groups) -> [F, *shape], the group's gradient as its ranks hold it, gathered.
    The reduce-scatter of the unit's buffer over the S shards, then (HSDP) the all-reduce of each
    shard's piece over the R replicas, both averages in the gradients' dtype (FSDP2's AVG for bf16
    and fp32), each summed in ring order (ring_mean); with `reduce_dtype` (fsdp.reduce_dtype) both
    in it, the result cast back to the gradients' dtype, as FSDP2's MixedPrecisionPolicy."""
    buffer = torch.cat([_padded(g, replicas, shards) for g in grads], dim=-1)  # [F, R, source, dest, m]
    buffer = buffer.to(reduce_dtype or buffer.dtype)
    groups, piece = buffer.shape[0], buffer.shape[-1]
    mine = ring_mean(buffer.reshape(groups, replicas, shards, shards * piece)).view(groups, replicas, shards, piece)
    mine = ring_mean(mine.transpose(1, 2)) if replicas > 1 else mine[:, 0]  # [F, dest, m]
    out, offset = [], 0
    for g in grads:
        rows, rest = g.shape[2], g.shape[3:]
        size = shard_piece(rows, shards) * math.prod(rest)
        whole = mine[..., offset : offset + size].reshape(groups, -1, *rest)[:, :rows]
        out.append(whole.to(g.dtype).contiguous())
        offset += size
    return out
