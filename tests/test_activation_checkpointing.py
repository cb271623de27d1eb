"""model.activation_checkpointing=full (fldp/model.py checkpoint_layers): each decoder layer's
forward runs again in its backward. Same numbers as none, bit for bit in fp32, through the real
trainer on real ranks; less activation memory, by torch's own FSDP memory tracker."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import compose_cfg, identical, run_world, train_world

from fldp.data import prepare
from fldp.mesh import MeshShape, build_mesh, group_mesh
from fldp.model import DTYPES, build_model, init_weights, llama_config, parallelize
from fldp.trainer import build_optimizer


@pytest.mark.parametrize("algorithm,topology", [("fsdp", "local_2"), ("fl_hsdp", "local_4")])
def test_full_checkpointing_trains_the_same_numbers_bit_for_bit(tmp_path, algorithm, topology):
    common = [f"algorithm={algorithm}", f"topology={topology}", "trainer.steps=4", "trainer.eval_every=2"]
    rows = {}
    for mode in ("none", "full"):
        cfg = compose_cfg(*common, f"model.activation_checkpointing={mode}", "model.num_hidden_layers=3")
        rows[mode] = [(r["step"], r["loss"]) for r in train_world(cfg, tmp_path / mode)]
    assert rows["full"] == rows["none"] and len(rows["none"]) == 4


def _peaks(cfg, blocks, out, device):
    """One step of an FSDP model under torch's FSDPMemTracker; rank 0 keeps the peak snapshot and
    the parameters after the optimiser step."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    shape = MeshShape(cfg.mesh.federation, cfg.mesh.replicate, cfg.mesh.shard)
    mesh = group_mesh(build_mesh(shape, "cpu"), shape)
    for mode in ("none", "full"):
        model = build_model(llama_config(cfg.model, blocks.vocab_size), device)
        model = parallelize(model, mesh, DTYPES["fp32"], activation_checkpointing=mode)
        init_weights(model, device, cfg.seed)
        optimizer = build_optimizer(model, cfg.optimizer)
        x = blocks.train[: cfg.trainer.batch_size].long()
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((x,))
        with tracker:
            model(input_ids=x, labels=x).loss.backward()
            optimizer.step()
        if dist.get_rank() == 0:
            (peak,) = tracker.get_tracker_snapshot("peak").values()
            out[mode] = {str(k): v for k, v in peak.items()}
            out[f"{mode}_params"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        else:
            [p.full_tensor() for p in model.parameters()]  # the same collectives as rank 0


def test_full_checkpointing_keeps_less_activation_memory(tmp_path):
    cfg = compose_cfg("algorithm=fsdp", "topology=local_2", "model.num_hidden_layers=4")
    blocks = prepare(cfg.dataset)
    out = torch.multiprocessing.Manager().dict()
    run_world(_peaks, 2, cfg, blocks, out)
    activation = {mode: out[mode]["_FSDPRefType.ACT"] for mode in ("none", "full")}
    assert activation["full"] < 0.75 * activation["none"], activation
    assert identical(out["none_params"], out["full_params"])
