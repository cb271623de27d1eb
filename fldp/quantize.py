"""Quantised aggregation (algorithm.outer.quantize): the groups' change since the last aggregation
crosses the network in 8 or 4 bits with a scale per block, and is summed in fp32 (Streaming DiLoCo,
Douillard et al. 2025; torchft's quantised all-reduce on NCCL does the same two stages).

A bucket's change (n fp32 elements) is padded to F chunks of whole blocks, one chunk per group:
1. each group quantises its change (plus, with error feedback, what its last quantisation lost)
   and sends chunk j to group j (all-to-all);
2. group j dequantises the F copies of its chunk, sums them in fp32 in group order, divides by F,
   quantises that mean and sends it to every group (all-gather);
3. every group dequantises the F mean chunks: the same bits everywhere.
Each stage sends (F - 1) / F of the quantised vector per rank, as a ring all-reduce's two halves do,
so the bytes are the payload's over the parameters' (int8 over bf16: 1/2, plus the scales' 4 bytes
per block).

Kinds: int8 (scale = absmax / 127, round to nearest even), int4 (absmax / 7, two per byte), fp8
e4m3 (absmax / 448, torch's cast to float8_e4m3fn, which saturates at 448); the integers clamped to
+-127 and +-7 (a subnormal absmax makes absmax / scale inexact: up to 127.6 in int8, rounding to
128). A block whose values are all zero gets scale 1. On the wire a chunk is its payload bytes
followed by its fp32 scales' bytes (one tensor per collective, so gloo moves plain uint8).

`quantized_mean` is the definition in one process (the simulator runs it; the trainer's
`all_reduce_mean` is the same arithmetic over the federation group's collectives).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import OuterConfig

KINDS = {"int8": (8, 127.0), "int4": (4, 7.0), "fp8": (8, 448.0)}  # bits, the largest magnitude


@dataclass(frozen=True)
class Quantizer:
    kind: str
    block: int = 256

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"algorithm.outer.quantize={self.kind!r}: must be null or one of {', '.join(KINDS)}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 2 or self.block % 2:
            raise ValueError(
                f"algorithm.outer.quantize_block={self.block!r}: must be an even integer >= 2 "
                "(elements per scale; int4 packs two per byte)"
            )

    # A codec's interface, all its callers use (the trainer's transport, the simulator, FedAvg's
    # buckets, the cost model): chunk, wire_bytes, mean, all_reduce_mean, residual.

    def mean(self, changes: list[torch.Tensor], residuals: list | None = None) -> torch.Tensor:
        """The groups' changes -> what the exchange leaves every group, in one process (quantized_mean)."""
        return quantized_mean(changes, self, residuals)

    def all_reduce_mean(self, flat: torch.Tensor, group, residual: torch.Tensor | None = None) -> None:
        """mean's arithmetic over the federation group's collectives, in place (all_reduce_mean)."""
        all_reduce_mean(flat, self, group, residual)

    def residual(self, numel: int, groups: int, device) -> torch.Tensor:
        """A zero error-feedback residual for a bucket of `numel` elements (residual_for)."""
        return residual_for(numel, groups, self, device)

    @property
    def bits(self) -> int:
        return KINDS[self.kind][0]

    def chunk(self, numel: int, groups: int) -> int:
        """Elements per group's chunk: the bucket split F ways, rounded up to whole blocks."""
        return math.ceil(numel / (groups * self.block)) * self.block

    def wire_bytes(self, elements: int) -> int:
        """Bytes of `elements` (whole blocks) on the wire: the payload and an fp32 scale per block."""
        return elements * self.bits // 8 + 4 * (elements // self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 x (whole blocks) -> uint8: payload, then the scales."""
        blocks = x.view(-1, self.block)
        scale = blocks.abs().amax(dim=1, keepdim=True) / KINDS[self.kind][1]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        scaled = blocks / scale
        # a subnormal absmax divides inexactly: absmax / scale can exceed the largest magnitude
        # (127.6, rounding to 128, which int8 wraps to -128), so the grid is clamped to +-qmax
        # (torch's cast to float8_e4m3fn saturates at 448 itself)
        qmax = KINDS[self.kind][1]
        if self.kind == "fp8":
            payload = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        elif self.kind == "int8":
            payload = scaled.round().clamp_(-qmax, qmax).to(torch.int8).view(torch.uint8)
        else:  # int4: q + 8 in [1, 15], the even element in the low nibble
            q = (scaled.round().clamp_(-qmax, qmax) + 8).to(torch.uint8).view(-1, 2)
            payload = q[:, 0] | (q[:, 1] << 4)
        return torch.cat([payload.reshape(-1), scale.reshape(-1).view(torch.uint8)])

    def decode(self, wire: torch.Tensor, elements: int) -> torch.Tensor:
        """uint8 from encode -> fp32 (`elements` of them)."""
        payload_bytes = elements * self.bits // 8
        scale = wire[payload_bytes:].clone().view(torch.float32).view(-1, 1)  # a copy: aligned for fp32
        payload = wire[:payload_bytes]
        if self.kind == "fp8":
            values = payload.view(torch.float8_e4m3fn).to(torch.float32)
        elif self.kind == "int8":
            values = payload.view(torch.int8).to(torch.float32)
        else:
            values = torch.stack([payload & 15, payload >> 4], dim=1).reshape(-1).to(torch.float32) - 8
        return (values.view(-1, self.block) * scale).reshape(-1)

    def send(self, x: torch.Tensor, chunks: int, residual: torch.Tensor | None) -> torch.Tensor:
        """What a group sends, as uint8: x (padded to `chunks` chunks of whole blocks) chunk by
        chunk, plus, with error feedback, what its last quantisation lost (`residual`, updated in
        place to what this one loses)."""
        if residual is not None:
            x = x + residual
        c = x.numel() // chunks
        wire = torch.cat([self.encode(part) for part in x.split(c)])
        if residual is not None:
            residual.copy_(x - self.receive(wire, chunks, c))
        return wire

    def receive(self, wire: torch.Tensor, chunks: int, elements: int) -> torch.Tensor:
        """send's inverse without the residual: the chunks (of `elements` each), decoded, joined."""
        return torch.cat(self.parts(wire, chunks, elements))

    def parts(self, wire: torch.Tensor, chunks: int, elements: int) -> list[torch.Tensor]:
        """The decoded chunks of a wire holding `chunks` encoded chunks of `elements` each."""
        size = self.wire_bytes(elements)
        return [self.decode(wire[j * size : (j + 1) * size], elements) for j in range(chunks)]


def _padded(x: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.zeros(numel, dtype=torch.float32, device=x.device)
    out[: x.numel()] = x
    return out


def _mean_of(copies: list[torch.Tensor]) -> torch.Tensor:
    """The groups' mean, summed in group order in fp32 (gloo has no AVG: sum, then divide)."""
    total = copies[0].clone()
    for c in copies[1:]:
        total += c
    return total.div_(len(copies))


def quantized_mean(changes: list[torch.Tensor], q: Quantizer, residuals: list | None = None) -> torch.Tensor:
    """The F groups' changes (fp32, n each) -> the quantised mean (fp32, n), in one process.
    residuals: each group's error feedback (F fp32 tensors of the padded length, updated), or None."""
    F, n = len(changes), changes[0].numel()
    c = q.chunk(n, F)
    sent = [
        q.parts(q.send(_padded(x, F * c), F, None if residuals is None else residuals[g]), F, c)
        for g, x in enumerate(changes)
    ]
    means = [q.encode(_mean_of([chunks[j] for chunks in sent])) for j in range(F)]  # chunk j's at group j
    return q.receive(torch.cat(means), F, c)[:n]


def all_reduce_mean(flat: torch.Tensor, q: Quantizer, group, residual: torch.Tensor | None = None) -> None:
    """flat (fp32, this rank's change) := the federation's quantised mean, through the group's
    collectives (all-to-all, then all-gather); quantized_mean's arithmetic. Blocking."""
    F, n = dist.get_world_size(group), flat.numel()
    c = q.chunk(n, F)
    mine = q.send(_padded(flat, F * c), F, residual)
    received = torch.empty_like(mine)
    dist.all_to_all_single(received, mine, group=group)  # chunk j of every group, at group j
    mean = q.encode(_mean_of(q.parts(received, F, c)))
    gathered = torch.empty_like(mine)
    dist.all_gather_single(gathered, mean, group=group)
    flat.copy_(q.receive(gathered, F, c)[:n])


def residual_for(numel: int, groups: int, q: Quantizer, device) -> torch.Tensor:
    """A zero error-feedback residual for a bucket of `numel` elements (its padded length)."""
    return torch.zeros(groups * q.chunk(numel, groups), dtype=torch.float32, device=device)


# The codecs by algorithm.outer.quantize's name (fldp/config.py QUANTIZE lists the same names): a new
# compression is a class with Quantizer's interface, named here
CODECS: dict[str, type[Quantizer]] = {kind: Quantizer for kind in KINDS}


def codec_of(outer: OuterConfig) -> Quantizer | None:
    """algorithm.outer's codec; None: the exchange is not compressed."""
    return CODECS[outer.quantize](outer.quantize, outer.quantize_block) if outer.quantize else None
