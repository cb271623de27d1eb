"""The gradient noise scale (fldp/noise_scale.py, McCandlish et al. 2018, appendix A): its estimator
recovers a known tr(Sigma) and |G|^2, and the simulator's measurement equals one computed rank by
rank with plain autograd, from the definition."""

import math

import torch
from conftest import compose_cfg, read_rows

from fldp.data import WorldBatches, prepare
from fldp.model import build_model, init_weights, llama_config
from fldp.noise_scale import estimate
from fldp.simulate import Simulation


def test_the_estimate_recovers_a_known_noise_and_signal():
    """Gradients of b-sequence means drawn around a known G with per-sequence covariance Sigma:
    g_k = G + e_k / sqrt(b), e_k ~ N(0, Sigma)."""
    torch.manual_seed(0)
    parts, small, dim = 20000, 4, 30
    true_g = torch.randn(dim, dtype=torch.float64) * 0.3
    scales = torch.rand(dim, dtype=torch.float64) * 2  # Sigma = diag(scales^2)
    noise = torch.randn(parts, dim, dtype=torch.float64) * scales / math.sqrt(small)
    halves = [(true_g + noise)[:, :10], (true_g + noise)[:, 10:]]  # two "parameters"
    got = estimate(halves, small)
    trace, signal = float((scales**2).sum()), float((true_g**2).sum())
    assert abs(got["noise_trace"] / trace - 1) < 0.03, (got, trace)
    assert abs(got["noise_signal"] / signal - 1) < 0.05, (got, signal)
    assert got["noise_scale"] == got["noise_trace"] / got["noise_signal"] and got["noise_batches"] == "20000 x 4"


def test_the_simulators_noise_scale_is_each_ranks_gradient_by_the_definition(tmp_path):
    overrides = [
        "algorithm=fl_fsdp",
        "topology=local_8",
        "trainer.steps=2",
        "cluster=simulate",
        "trainer.eval_batches=1",
    ]
    cfg = compose_cfg(*overrides, "cluster.noise_scale_every=2")
    blocks = prepare(cfg.dataset)
    Simulation(cfg, blocks, torch.device("cpu")).run(str(tmp_path / "noise"))
    Simulation(compose_cfg(*overrides), blocks, torch.device("cpu")).run(str(tmp_path / "plain"))
    row, after = read_rows(tmp_path / "noise")
    # measured at step 1 and every 2nd, off the algorithm's path: the records are the plain run's
    assert {"noise_scale", "noise_trace", "noise_signal"} <= after.keys() and after["noise_batches"] == "8 x 2"
    assert [r["loss"] for r in read_rows(tmp_path / "noise")] == [r["loss"] for r in read_rows(tmp_path / "plain")]
    assert [r["loss"] for r in read_rows(tmp_path / "noise", "eval")] == [
        r["loss"] for r in read_rows(tmp_path / "plain", "eval")
    ]
    # the reference at step 1: the initial weights (every group's), each rank's sequences, one
    # plain backward each
    model = build_model(llama_config(cfg.model, blocks.vocab_size), "meta")
    init_weights(model, torch.device("cpu"), cfg.seed)
    x = next(WorldBatches(blocks.train, cfg.trainer.batch_size, 8, cfg.seed).stream())  # [world, batch, T]
    grads = []
    for rank in x:
        model.zero_grad()
        model(input_ids=rank, labels=rank).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).double())
    g = torch.stack(grads)
    small_sq, big_sq, b, big = (g**2).sum(1).mean(), (g.mean(0) ** 2).sum(), 2, 16
    signal = float((big * big_sq - b * small_sq) / (big - b))
    trace = float((small_sq - big_sq) / (1 / b - 1 / big))
    assert math.isclose(row["noise_signal"], signal, rel_tol=1e-4), (row["noise_signal"], signal)
    assert math.isclose(row["noise_trace"], trace, rel_tol=1e-4), (row["noise_trace"], trace)
