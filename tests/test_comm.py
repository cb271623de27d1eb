"""The cost model against hand-computed values, and against the bytes that really cross each
process group in tiny runs of all four algorithms."""

import json

import pytest
import torch
from conftest import cli, compose_cfg, read_rows, run_world

from fldp.comm import CommMeter
from fldp.config import load
from fldp.cost import Units, model_units, predict, predict_for, tier_bandwidth
from fldp.mesh import MeshShape, build_mesh, mesh_shape
from fldp.model import DTYPES, build_model, llama_config
from fldp.streaming import StreamingConfig


def test_paper_equations_on_a_hand_computed_example():
    # one layer of 4 x 250 fp32 = 4,000 bytes; S=2 -> M L = 2,000 bytes
    units = Units(params=(((4, 250), 0),), element_size=4)
    bw = {"shard": 1000.0, "replicate": 1000.0, "federation": 500.0}
    # the one unit is the root; resharded after forward it is gathered twice, like the paper's layers
    p = predict(units, MeshShape(4, 2, 2), bw, every=2, reshard_root_after_forward=True)
    assert p.paper["shard"] == pytest.approx(2000 * 3 * 1 / (2 * 1000))  # Eq. 1: 3 s
    assert p.paper["replicate"] == pytest.approx(2000 * 2 * 1 / (2 * 1000))  # Eq. 2: 2 s
    assert p.paper["federation"] == pytest.approx(2000 / 2 * 2 * 3 / (4 * 500))  # Eq. 3: 3 s
    assert p.paper["broadcast"] == pytest.approx(2000 / 2 / 1000)  # Eq. 5: 1 s
    # byte-exact: the all-gather of a layer in S shards of M sends (S-1) M per rank, not (S-1) M / S
    assert p.step_bytes["shard"] == 3 * (2 - 1) * 2000
    assert p.exact["shard"] == pytest.approx(2 * p.paper["shard"])  # S times the paper's
    # FSDP1's root policy (the default): kept gathered from forward to backward, one all-gather fewer
    kept = predict(units, MeshShape(4, 2, 2), bw, every=2)
    assert kept.step_bytes["shard"] == 2 * (2 - 1) * 2000 and kept.step_collectives["shard"] == 2
    fsdp = predict(units, MeshShape(1, 1, 2), bw)
    assert fsdp.paper["replicate"] == fsdp.paper["federation"] == fsdp.exact["federation"] == 0


def test_schedule_federate_and_reduce_dtype_on_a_hand_computed_example():
    # a: 4 x 250 and b: 2 x 100 bf16 (2 bytes), S=2, F=2; shard 0 holds 2 rows of a, 1 of b
    units = Units(params=(((4, 250), 0), ((2, 100), 1)), element_size=2, names=("a", "b"))
    bw = {"shard": 1000.0, "replicate": 1000.0, "federation": 500.0}
    # [[0,2],[3,3]] over 6 steps aggregates at 2, 5 and 6 (the last): 3 aggregations in 6 steps;
    # only `a` is federated (its shard: 2 x 250 x 2 = 1,000 bytes), summed in fp32 (x2: 2,000 bytes)
    p = predict(
        units, MeshShape(2, 1, 2), bw, every=[[0, 2], [3, 3]], steps=6, federated=[True, False], reduce_element_size=4
    )
    assert p.aggregations_per_step == 3 / 6
    assert p.aggregation_bytes["federation"] == 2 * (2 - 1) / 2 * 2000
    assert p.bytes_per_step["federation"] == 2000 * 3 / 6
    assert p.paper["federation"] == pytest.approx(2 * 2000 * (2 - 1) / (2 * 500) * 3 / 6)  # Eq. 3, M L = 2,000
    # with replicas: the leader broadcasts the new weights in the parameters' dtype (1,000 bytes of
    # `a`'s shard, not the fp32 sum's 2,000): half of them cross to the one other replica
    h = predict(
        units, MeshShape(2, 2, 2), bw, every=[[0, 2], [3, 3]], steps=6, federated=[True, False], reduce_element_size=4
    )
    assert h.aggregation_bytes["replicate"] == (2 - 1) / 2 * 1000 and h.aggregation_bytes["federation"] == 2000
    assert h.paper["broadcast"] == pytest.approx(1000 / 1000 * 3 / 6)  # Eq. 5 on M L = 1,000 bytes
    # no steps: the long-run rate, one aggregation per last A; all federated, in the parameters' dtype
    q = predict(units, MeshShape(2, 1, 2), bw, every=[[0, 2], [3, 3]])
    assert q.aggregations_per_step == 1 / 3 and q.aggregation_bytes["federation"] == 1000 + 1 * 100 * 2


def test_fragments_and_overlap_on_a_hand_computed_example():
    """Streaming: names give the units (root; layers 0 and 1), P = 2 strided puts the root and layer
    1 in fragment 0, layer 0 in fragment 1. fp32, S = 1, F = 2 at 500 B/s: an all-reduce sends
    2 (F-1)/F = 1x its payload per rank."""
    names = ("model.embed_tokens.weight", "model.layers.0.w", "model.layers.1.w")
    units = Units(params=(((10, 10), 2), ((5, 10), 0), ((3, 10), 1)), element_size=4, names=names)
    bw = {"shard": 1000.0, "replicate": 1000.0, "federation": 500.0}
    streaming = StreamingConfig(fragments=2, overlap=1)
    p = predict(units, MeshShape(2, 1, 1), bw, every=4, steps=8, streaming=streaming)
    assert [f["federation"] for f in p.fragment_bytes] == [(100 + 30) * 4, 50 * 4]  # 520 and 200 bytes
    assert p.peak_aggregation_bytes == 520 and p.aggregation_bytes["federation"] == 720
    # the layers alone federated: the trainer deals the fragments over the units it federates (layer 0
    # in fragment 0, layer 1 in fragment 1); the root, left local, is in none
    layers = predict(
        units, MeshShape(2, 1, 1), bw, every=4, steps=8, streaming=streaming, federated=[False, True, True]
    )
    assert [f["federation"] for f in layers.fragment_bytes] == [50 * 4, 30 * 4]
    assert p.fragment_seconds == [520 / 500, 200 / 500]
    # fragment 0 sent at 1, 5 and the last step, 8; fragment 1 at 3 and 7 (in flight at 8, merged
    # there): 520 x 3 + 200 x 2 bytes over 8 steps
    assert p.bytes_per_step["federation"] == pytest.approx((520 * 3 + 200 * 2) / 8)
    # in flight during one step of 0.8 s: 1.04 - 0.8 = 0.24 s of fragment 0 left on the critical
    # path per period, none of fragment 1's 0.4 s; without overlap all 1.44 s
    assert p.exposed_aggregation(0.8) == pytest.approx(0.24) and p.exposed_aggregation(2.0) == 0.0
    assert predict(
        units, MeshShape(2, 1, 1), bw, every=4, steps=8, streaming=StreamingConfig(fragments=2)
    ).exposed_aggregation(0.8) == pytest.approx(1.44)
    # with 2 replicas (leader_broadcast) the merge's broadcast stays on the critical path: gloo's flat
    # broadcast sends each fragment's weights times at the replicate tier's 1000 B/s
    h = predict(units, MeshShape(2, 2, 1), bw, every=4, steps=8, streaming=streaming)
    assert h.fragment_broadcast_seconds == [520 / 1000, 200 / 1000]
    assert h.exposed_aggregation(0.8) == pytest.approx(0.24 + 0.52 + 0.2)


def test_fsdp2_padding_is_accounted():
    units = Units(params=(((5, 3), 0), ((7,), 1)), element_size=2)
    assert units.padded_shard_bytes(4) == [2 * 3 * 2, 2 * 2]  # ceil(5/4)=2 rows, ceil(7/4)=2
    assert units.local_shards(4, 3) == [0, 1 * 2]  # rank 3: 5-3*2<0 rows; 7-6=1


def test_tiers_follow_the_rank_blocks():
    network = [{"ranks": 4, "gbit_s": 800}, {"ranks": 512, "gbit_s": 200}]
    b = tier_bandwidth(network, MeshShape(16, 8, 4))  # FL+HSDP on Leonardo
    assert b == {"shard": 100e9, "replicate": 25e9, "federation": 25e9}
    assert tier_bandwidth(network, MeshShape(1, 1, 512))["shard"] == 25e9


CASES = [  # (overrides, ...) tiny runs of 3 steps, A=2 unless given: aggregations at steps 2 and 3
    ["algorithm=fsdp"],
    ["algorithm=hsdp"],
    ["algorithm=fl_fsdp"],
    ["algorithm=fl_hsdp"],
    ["algorithm=fl_hsdp", "algorithm.fedavg.mode=all_replicas", "algorithm.fedavg.bucket_mb=0.1"],
    ["algorithm=hsdp", "topology=local_2"],  # S=1: nothing to shard
    ["algorithm=fsdp", "fsdp.reshard_root_after_forward=true"],  # not the authors' root policy
    # a schedule: 2, then 3 counted from the aggregation at 2 (5), and the last step (6)
    ["algorithm=fl_fsdp", "topology=local_4", "trainer.steps=6", "algorithm.every=[[0,2],[3,3]]"],
    # only the decoder layers averaged (and broadcast: 2x2x1)
    ["algorithm=fl_hsdp", "topology=local_4", "algorithm.federate=[model\\.layers\\..*]"],
    # bf16 weights summed in fp32 (twice their bytes), fp32 weights summed in bf16 (half); so are the
    # gradients (fsdp.reduce_dtype): HSDP's all-reduce over 2 replicas, FSDP's reduce-scatter over 2 shards
    [
        "algorithm=fl_hsdp",
        "topology=local_4",
        "trainer.precision=bf16",
        "algorithm.outer.reduce_dtype=fp32",
        "fsdp.reduce_dtype=fp32",
    ],
    ["algorithm=fl_fsdp", "topology=local_4", "algorithm.outer.reduce_dtype=bf16", "fsdp.reduce_dtype=bf16"],
    # streaming: 2 fragments, each all-reduced the step before its merge (sent at 1, 3, 5; merged
    # at 2, 4, 6), its new weights broadcast to the replicas at the merge; the last step both
    [
        "algorithm=fl_hsdp",
        "topology=local_8",
        "trainer.steps=6",
        "algorithm.every=4",
        "algorithm.streaming.fragments=2",
        "algorithm.streaming.overlap=1",
        "algorithm.fedavg.bucket_mb=0.1",
    ],
    # quantised (fldp/quantize.py): each bucket's change padded to F chunks of whole blocks, its payload
    # and scales in an all-to-all and an all-gather; then broadcast to the replicas in fp32 (2x2x2)
    ["algorithm=fl_hsdp", "topology=local_8", "algorithm.outer.quantize=int8", "algorithm.fedavg.bucket_mb=0.1"],
    [
        "algorithm=fl_fsdp",
        "topology=local_8",
        "mesh.federation=4",
        "mesh.shard=2",
        "algorithm.outer.quantize=int4",
        "algorithm.outer.error_feedback=true",
        "algorithm.outer.quantize_block=64",
    ],
]
# algorithm.every -> the steps that aggregate, by hand (4: streaming's sends and merges)
AGGREGATED = {"[[0,2],[3,3]]": [2, 5, 6], "2": [2, 3], "4": [1, 2, 3, 4, 5, 6]}


@pytest.mark.parametrize("overrides", CASES, ids=["-".join(o.split("=")[1] for o in c) for c in CASES])
def test_measured_bytes_equal_the_exact_model(tmp_path, overrides):
    args = ["trainer.steps=3", "algorithm.every=2", *overrides]  # the case's own win
    out = cli(*args, "wandb.mode=disabled", "trainer.eval_batches=1", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = compose_cfg(*args)
    shape = mesh_shape(cfg)
    units = model_units(build_model(llama_config(cfg.model, 4096), "meta"), DTYPES[cfg.trainer.precision])
    pred = predict_for(load(cfg), units)  # the schedule, federate, reduce dtype, mode, buckets of the config
    rows = read_rows(tmp_path)
    if cfg.algorithm.aggregation:
        every = next(a.split("=", 1)[1] for a in reversed(args) if a.startswith("algorithm.every="))
        assert [r["step"] for r in rows if r["aggregated"]] == AGGREGATED[every]
        summary = json.loads((tmp_path / "summary.json").read_text())
        if "fragments" not in rows[0]:  # summary's aggregation_steps: the whole model's schedule
            assert summary["aggregation_steps"] == AGGREGATED[every]
    if shape.shard > 1:  # per layer 2 all-gathers + 1 reduce-scatter; the root gathers once unless resharded
        units_ = cfg.model.num_hidden_layers + 1
        assert rows[0]["collectives_shard"] == 3 * units_ - (0 if cfg.fsdp.reshard_root_after_forward else 1)
    for row in rows:
        expected = pred.expected_row(row["aggregated"], row.get("fragments_sent"), row.get("fragments"))
        measured = {k: row[k] for k in expected}
        assert measured == pytest.approx(expected, rel=1e-12), f"step {row['step']}"
    # over the whole run, the bytes the model amortises per step are the bytes sent
    for d in ("shard", "replicate", "federation"):
        assert sum(r[f"bytes_{d}"] for r in rows) == pytest.approx(len(rows) * pred.bytes_per_step[d], rel=1e-12), d
    if "bucket_mb=0.1" in overrides:
        assert pred.aggregation_collectives["federation"] > 5  # several buckets, each tensor once
    if "algorithm.streaming.fragments=2" in overrides:  # the fragments' bytes add up to the model's
        assert [r["fragments_sent"] for r in rows] == [[0], [], [1], [], [0], [1]]
        parts = [f["federation"] for f in pred.fragment_bytes]  # fragment 0 holds the root: the embeddings
        assert sum(parts) == pred.aggregation_bytes["federation"] and pred.peak_aggregation_bytes == max(parts)


def _meter_rank(device):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    mesh = build_mesh(MeshShape(1, 1, 2), "cpu")
    shard, other = mesh["shard"].get_group(), dist.new_group([0, 1])
    originals = [getattr(m, n) for m in (dist, c10d) for n in ("all_reduce", "all_gather_single", "broadcast")]
    meter = CommMeter(mesh)
    x = torch.ones(4)  # 16 bytes, 2 ranks
    with meter:
        dist.all_reduce(x, group=shard)  # 2 (n-1)/n 16 = 16
        dist.all_gather_into_tensor(torch.empty(8), x, group=shard)  # calls all_gather_single: once, 16
        dist.reduce_scatter_single(output=torch.empty(2), input=x, group=shard)  # FSDP2's keywords: 8
        dist.all_reduce(x, group=shard, async_op=True).wait()  # 16
        dist.broadcast(x, group=other, group_src=0)  # not a mesh dimension: 8
    dist.all_reduce(x)  # outside the meter (the trainer's stats)
    assert [getattr(m, n) for m in (dist, c10d) for n in ("all_reduce", "all_gather_single", "broadcast")] == originals
    assert meter.take() == {
        "bytes_federation": 0,
        "bytes_replicate": 0,
        "bytes_shard": 56,
        "collectives_federation": 0,
        "collectives_replicate": 0,
        "collectives_shard": 4,
        "bytes_other": 8,
        "collectives_other": 1,
    }
    assert meter.take()["collectives_shard"] == 0


def test_meter_counts_only_inside_and_restores_torch_distributed():
    run_world(_meter_rank, 2)


def test_emulated_tiers_slow_collectives_down(tmp_path):
    """With emulation every step lasts at least the exact model's time on the emulated tiers."""
    args = ["algorithm=fsdp", "trainer.steps=2", "comm.emulate=true", "comm.scale=1e-3"]
    out = cli(*args, "wandb.mode=disabled", "trainer.eval_batches=1", f"hydra.run.dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = compose_cfg(*args)
    shape = mesh_shape(cfg)
    bandwidth = tier_bandwidth(cfg.topology.network, shape, cfg.comm.scale)
    units = model_units(build_model(llama_config(cfg.model, 4096), "meta"), torch.float32)
    floor = sum(predict(units, shape, bandwidth).exact.values())
    assert floor > 0.1
    for row in read_rows(tmp_path):
        assert row["time_step"] >= floor
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["comm_emulated"] is True and summary["comm_scale"] == 1e-3
    assert summary["network"] == "sleep"


def test_cost_rows_for_the_paper_setting():
    """fldp-cost's rows (what --json prints; tests/test_cost_cli.py runs the installed command)."""
    from fldp.cost import table

    def run(*overrides):
        conf = load(compose_cfg("topology=leonardo_512", "model=llama3_1_8b", *overrides))
        return {r["algorithm"]: r for r in table(conf)}

    rows = run()
    assert rows["fsdp"]["mesh"] == "1x1x512" and rows["fl_hsdp"]["mesh"] == "16x8x4"
    # (S-1) M vs (S-1) M / S on one tier (FSDP2 pads the 128,256-row embedding to a multiple of 512),
    # less the root's second all-gather (FSDP1's root policy): embeddings + lm_head + norm of 8.03 B
    root, total = 2 * 128_256 * 4096 + 4096, 8_030_261_248
    assert rows["fsdp"]["exact_over_paper"] == pytest.approx(512 * (3 * total - root) / (3 * total), rel=1e-3)
    resharded = run("fsdp.reshard_root_after_forward=true")
    assert resharded["fsdp"]["exact_over_paper"] == pytest.approx(512, rel=1e-3)
    assert rows["fl_fsdp"]["measured_step_s"] == 1.45
    # the schedule, partial federation and reduce dtype of the configured algorithm: 1..16, 24, ..., 64 is
    # 22 aggregations in 64 steps (8 with A=8), the decoder layers only (S=4 splits every parameter
    # evenly), in fp32 (twice bf16's bytes)
    other = run(
        "algorithm=fl_fsdp",
        "algorithm.every=[[0,1],[16,8]]",
        "algorithm.federate=[model\\.layers\\..*]",
        "algorithm.outer.reduce_dtype=fp32",
    )
    layers = (total - root) / total
    assert other["fl_fsdp"]["bytes_federation_per_step"] / rows["fl_fsdp"][
        "bytes_federation_per_step"
    ] == pytest.approx(22 / 8 * layers * 2, rel=1e-12)
    assert other["fl_fsdp"]["aggregations_per_step"] == 22 / 64
