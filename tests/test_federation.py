"""FedAvg across federation groups, on real processes over gloo."""
import math

import pytest
import torch

from conftest import Snapshot, compose_cfg, identical, read_rows, train_world

# FL+HSDP 2x2x2 with A=3 over 7 steps: aggregations at 3, 6 and the forced last step 7.
STEPS, EVERY = 7, 3
AGGREGATED = {3, 6, 7}


@pytest.fixture(scope="module")
def fl_hsdp_runs(tmp_path_factory):
    """One FL+HSDP run per FedAvg mode, every replica's parameters after every step."""
    runs = {}
    for mode in ("leader_broadcast", "all_replicas"):
        out = tmp_path_factory.mktemp(mode)
        cfg = compose_cfg("algorithm=fl_hsdp", "topology=local_8", f"trainer.steps={STEPS}",
                          f"algorithm.every={EVERY}", f"algorithm.fedavg.mode={mode}")
        snap = Snapshot(out, range(1, STEPS + 1), cfg)
        runs[mode] = (snap, train_world(cfg, out / "run", snap))
    return runs


def test_groups_identical_after_aggregation_and_differ_between(fl_hsdp_runs):
    snap, rows = fl_hsdp_runs["leader_broadcast"]
    assert [r["aggregated"] for r in rows] == [s in AGGREGATED for s in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        replicas = {(f, r): snap.load(f, r, step) for f in range(2) for r in range(2)}
        # HSDP replicas inside a group always agree
        for f in range(2):
            assert identical(replicas[f, 0], replicas[f, 1]), f"group {f} replicas differ at step {step}"
        same = identical(replicas[0, 0], replicas[1, 0])
        assert same == (step in AGGREGATED), f"step {step}: groups identical={same}"


def test_leader_broadcast_equals_all_replicas_bitwise(fl_hsdp_runs):
    (a, rows_a), (b, rows_b) = fl_hsdp_runs["leader_broadcast"], fl_hsdp_runs["all_replicas"]
    assert [r["loss"] for r in rows_a] == [r["loss"] for r in rows_b]
    for step in range(1, STEPS + 1):
        for f in range(2):
            for r in range(2):
                assert identical(a.load(f, r, step), b.load(f, r, step))


def test_fl_fsdp_with_tied_embeddings(tmp_path):
    """FL+FSDP 2x1x4, A=2, a model whose lm_head shares the embedding: still one parameter,
    averaged once, groups identical after aggregation."""
    cfg = compose_cfg("algorithm=fl_fsdp", "topology=local_8", "trainer.steps=3", "algorithm.every=2",
                      "model.tie_word_embeddings=true")
    snap = Snapshot(tmp_path, [1, 2, 3], cfg)
    train_world(cfg, tmp_path / "run", snap)
    g0, g1 = snap.load(0, 0, 2), snap.load(1, 0, 2)
    assert "lm_head.weight" not in g0  # tied: named_parameters lists the shared tensor once
    assert identical(g0, g1)
    assert not identical(snap.load(0, 0, 1), snap.load(1, 0, 1))
    assert identical(snap.load(0, 0, 3), snap.load(1, 0, 3))  # forced final aggregation


def test_intermediate_evaluation_scores_the_groups_average(tmp_path):
    """FL+FSDP 2x1x2, A=2, evaluation every step: at step 1 the groups differ, and the evaluation
    scores their average (and each group), checked against plain single-process models built from
    the groups' weights; training is not changed by it."""
    from fldp.data import prepare
    from fldp.model import build_model, llama_config

    common = ["algorithm=fl_fsdp", "topology=local_4", "trainer.steps=2", "algorithm.every=2",
              "trainer.eval_batches=null", "dataset.eval_blocks=8"]
    cfg = compose_cfg(*common, "trainer.eval_every=1")
    snap = Snapshot(tmp_path / "eval", [1, 2], cfg)
    rows = train_world(cfg, tmp_path / "eval" / "run", snap)
    evals = read_rows(tmp_path / "eval" / "run", "eval")
    assert [e["step"] for e in evals] == [1, 2]
    groups = [snap.load(f, 0, 1) for f in range(2)]
    assert not identical(*groups)

    blocks = prepare(cfg.dataset)

    def score(params):  # mean loss over the whole held-out split, one unsharded model
        model = build_model(llama_config(cfg.model, blocks.vocab_size))
        model.load_state_dict(params, strict=False)  # parameters only; the rotary buffer is built
        with torch.no_grad():
            return sum(model(input_ids=x[None].long(), labels=x[None].long()).loss.item() for x in blocks.eval) / len(blocks.eval)

    average = {n: (groups[0][n] + groups[1][n]) / 2 for n in groups[0]}
    assert evals[0]["averaged"] is True
    assert evals[0]["loss"] == pytest.approx(score(average), rel=1e-5)
    for f in range(2):
        assert math.log(evals[0]["group_perplexity"][f]) == pytest.approx(score(groups[f]), rel=1e-5)
    assert "group_perplexity" not in evals[1]  # step 2 aggregated: one model, scored as at the end

    plain = train_world(compose_cfg(*common), tmp_path / "plain" / "run")
    assert [r["loss"] for r in plain] == [r["loss"] for r in rows]  # the evaluation changed nothing
