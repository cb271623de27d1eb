"""Memory per rank: what one rank holds at its peak, term by term, from the model's shapes and the
layout (issue 31). No torch kernel runs: the planner asks it of an 8B model on a laptop.

The peak of a step is at the start of backward, where the loss's gradient over the vocabulary
meets everything forward kept:
- state: this rank's parameter shards (FSDP2 pads each parameter's dim 0 to a multiple of S), the
  inner optimiser's state (AdamW: two moments in the parameters' dtype, a step count per tensor),
  the outer optimiser's (fp32: the anchor, momentum or Adam's moments; a quantised exchange's
  reference and error-feedback residual), the model's buffers and the batch;
- gathered parameters: the root unit (embeddings, final norm, lm_head), held from forward to
  backward, and the decoder layer FSDP2 all-gathers ahead of its backward;
- activations: what autograd keeps per decoder layer (`layer_activations`), or only each layer's
  input with activation checkpointing; the final norm's and the lm_head's inputs; the logits in
  fp32 (the loss upcasts them);
- the loss's backward: two fp32 tensors of the logits' size (log-softmax's gradient and its input's).
Gradients come after this peak (their shards replace the freed activations), so they count in
the other candidate, after backward (`after_backward`), which is the peak only for a model whose
state outweighs its activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config import Config

if TYPE_CHECKING:
    from .outer import OuterConfig

FP32 = 4
INDEX = 8  # int64 token ids


@dataclass(frozen=True)
class Shapes:
    """What the terms need of the model: transformers' LlamaConfig's dimensions."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def of(cls, config) -> Shapes:
        return cls(
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.vocab_size,
        )


def layer_activations(m: Shapes, batch: int, seq: int, element: int) -> int:
    """Bytes one decoder layer of transformers' Llama (sdpa) keeps for backward, per rank:
    per token, six hidden-sized tensors (the two norms' inputs and outputs, the attention output
    and the residual), query and attention output per head, key and value per KV head, four of
    the MLP's width (gate, up, SiLU and the product), the attention's log-sum-exp per head and the
    two norms' inverse RMS in fp32; below fp32, the attention norm's fp32 upcast of its input.
    The rotary cos and sin, which every layer keeps, are one pair for all (`rotary_tables`)."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    per_token = element * (6 * m.hidden + 2 * q + 2 * kv + 4 * m.intermediate) + FP32 * (m.heads + 2)
    if element < FP32:
        per_token += FP32 * m.hidden
    return batch * seq * per_token


def rotary_tables(m: Shapes, seq: int, element: int) -> int:
    """The rotary embedding's cos and sin for the sequence's positions, shared by every layer."""
    return 2 * seq * m.head_dim * element


def head_activations(m: Shapes, batch: int, seq: int, element: int) -> int:
    """The final norm's and the lm_head's saved inputs, and the logits in fp32 (the loss's upcast)."""
    tokens = batch * seq
    norm = tokens * (2 * element * m.hidden + FP32 + (FP32 * m.hidden if element < FP32 else 0))
    return norm + tokens * m.vocab * FP32


@dataclass
class Memory:
    """Bytes per rank, by term; `peak` is the larger of the two candidates."""

    terms: dict[str, int] = field(default_factory=dict)
    after_backward: dict[str, int] = field(default_factory=dict)

    @property
    def at_backward(self) -> int:
        return sum(self.terms.values())

    @property
    def peak(self) -> int:
        return max(self.at_backward, sum(self.after_backward.values()))


def predict_memory(
    units,
    m: Shapes,
    shard: int,
    batch: int,
    seq: int,
    optimizer: str = "adamw",
    momentum: float = 0.0,
    outer: OuterConfig | None = None,
    federated_bytes: int = 0,
    checkpointing: str = "none",
    buffers: int = 0,
) -> Memory:
    """units: fldp.cost.Units (the parameters by FSDP unit, in their dtype); shard: S; batch, seq:
    the rank's sequences per step and their length; outer: the outer optimiser's config
    (None: no federation); federated_bytes: this rank's unpadded local shards of the federated
    parameters, in the parameters' dtype."""
    e = units.element_size
    params = sum(units.padded_shard_bytes(shard))
    tensors = len(units.params)
    state = {
        "parameters": params,
        "optimizer": _inner_state(optimizer, momentum, params, tensors),
        "outer": _outer_state(outer, federated_bytes // e),
        "buffers and batch": buffers + batch * seq * INDEX,
    }
    full = units.full_bytes()
    root, largest_layer = full[-1], max(full[:-1], default=0)
    if checkpointing == "full":  # each layer's input only
        layers = m.layers * batch * seq * m.hidden * e
    else:
        layers = m.layers * layer_activations(m, batch, seq, e)
    layers += rotary_tables(m, seq, e)
    logits = batch * seq * m.vocab * FP32
    memory = Memory()
    memory.terms = {
        **state,
        "root unit gathered": root,
        "next layer gathered": largest_layer,
        "activations": layers + head_activations(m, batch, seq, e),
        "loss backward": 2 * logits,
    }
    memory.after_backward = {**state, "gradients": params, "root unit gathered": root}
    return memory


def _inner_state(name: str, momentum: float, params: int, tensors: int) -> int:
    if name == "adamw":
        return 2 * params + FP32 * tensors  # exp_avg, exp_avg_sq; `step` a 0-d fp32 tensor each
    return params if momentum else 0  # SGD's momentum buffer


def _outer_state(outer: OuterConfig | None, elements: int) -> int:
    """fp32 anchor and outer state (FedAvg itself, sgd lr 1 without momentum, keeps none); a
    quantised exchange's reference (without an outer optimiser: the parameters' dtype, counted
    here as fp32, an upper bound) and residual (fp32)."""
    if outer is None:
        return 0
    plain = outer.averages
    slots = 0 if plain else 1 + (2 if outer.name == "adam" else 1 if outer.momentum else 0)
    if outer.quantize and plain:
        slots += 1
    if outer.error_feedback:
        slots += 1
    return slots * elements * FP32


def for_config(conf: Config, model, units, shape=None) -> Memory:
    """The memory per rank of a config's run (rank 0: shard index 0 holds the largest
    shards), on its mesh or on `shape` (fldp.mesh.MeshShape). model: the config's Llama on the meta
    device; units: fldp.cost.model_units of it in the run's dtype."""
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return for_shapes(conf, Shapes.of(model.config), buffers, units, shape)


def for_shapes(conf: Config, shapes: Shapes, buffers: int, units, shape=None) -> Memory:
    """for_config from the model's dimensions and its buffers' bytes, without the model itself
    (fldp-plan's: fldp.cost.config_shapes)."""
    from .aggregation import FedAvgConfig

    shard = shape.shard if shape is not None else conf.mesh.shard
    config = FedAvgConfig.from_algorithm(conf.algorithm)
    outer, federated = None, 0
    if config is not None and (shape is None or shape.federation > 1):
        outer = config.outer
        keep = config.federated(list(units.names))
        federated = sum(b for b, k in zip(units.local_shards(shard, 0), keep) if k)
    return predict_memory(
        units,
        shapes,
        shard,
        conf.trainer.batch_size,
        conf.dataset.block_size,
        conf.optimizer.name,
        conf.optimizer.momentum,
        outer,
        federated,
        conf.model.activation_checkpointing,
        buffers,
    )


def llama_parameters(m: Shapes, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' LlamaForCausalLM's named_parameters (names and shapes, in order; no biases), from
    its dimensions alone: fldp-plan needs only these, and building the model means importing
    transformers (seconds). tests/test_memory.py checks them against the model's."""
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj": (q, m.hidden),
        "self_attn.k_proj": (kv, m.hidden),
        "self_attn.v_proj": (kv, m.hidden),
        "self_attn.o_proj": (m.hidden, q),
        "mlp.gate_proj": (m.intermediate, m.hidden),
        "mlp.up_proj": (m.intermediate, m.hidden),
        "mlp.down_proj": (m.hidden, m.intermediate),
        "input_layernorm": (m.hidden,),
        "post_attention_layernorm": (m.hidden,),
    }
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (m.vocab, m.hidden))]
    out += [(f"model.layers.{i}.{k}.weight", v) for i in range(m.layers) for k, v in layer.items()]
    out.append(("model.norm.weight", (m.hidden,)))
    return out if tied else [*out, ("lm_head.weight", (m.vocab, m.hidden))]  # tied: the embedding's


def rotary_buffers(m: Shapes) -> int:
    """Bytes of the model's buffers: the rotary embedding's inv_freq and original_inv_freq, fp32,
    head_dim / 2 each (tests/test_memory.py checks them against the model's)."""
    return 2 * (m.head_dim // 2) * FP32
