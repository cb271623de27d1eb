"""The sharded algorithms against plain single-process PyTorch, fp32 on CPU, same global data."""

import pytest
import torch
from conftest import Snapshot, compose_cfg, train_world
from transformers import get_cosine_schedule_with_warmup

from fldp.data import RankBatches, prepare
from fldp.model import build_model, init_weights, llama_config
from fldp.trainer import build_optimizer

STEPS, WORLD = 10, 8


def single_process(cfg):
    """The oracle: one unsharded model, each step's global batch = the 8 ranks' batches together."""
    blocks = prepare(cfg.dataset)
    model = build_model(llama_config(cfg.model, blocks.vocab_size))
    init_weights(model, torch.device("cpu"), cfg.seed)  # the run's init (tests/test_init.py checks it)
    optimizer = build_optimizer(model, cfg.optimizer)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(cfg.optimizer.warmup * STEPS), STEPS)
    ranks = [RankBatches(blocks.train, cfg.trainer.batch_size, r, WORLD, cfg.seed).stream() for r in range(WORLD)]
    losses = []
    for _ in range(STEPS):
        x = torch.cat([next(it) for it in ranks])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def sharded(tmp_path, *overrides, initial: bool = False):
    cfg = compose_cfg("topology=local_8", f"trainer.steps={STEPS}", *overrides)
    snap = Snapshot(tmp_path, [0, STEPS], cfg)
    rows = train_world(cfg, tmp_path / "run", snap)
    final = snap.load(0, 0, STEPS)
    return (cfg, final, [r["loss"] for r in rows]) + ((snap.load(0, 0, 0),) if initial else ())


def moved(params: dict, initial: dict) -> bool:
    """Training changed the weights: some parameter moved by more than 1e-3 from the run's own start."""
    return any((params[n] - initial[n]).abs().max() > 1e-3 for n in initial)


def assert_close(a: dict, b: dict, tol: float):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("algorithm", ["fsdp", "hsdp"])
def test_adamw_matches_single_process(tmp_path, algorithm):
    cfg, params, losses, initial = sharded(tmp_path, f"algorithm={algorithm}", initial=True)
    expected, expected_losses = single_process(cfg)
    assert moved(params, initial) and not moved(initial, initial)  # training moved the real initial weights
    assert_close(params, expected, 1e-5)
    # per-step perplexity: the mean of the 8 ranks' losses equals the global-batch loss
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), rtol=1e-5, atol=1e-5)


SGD = ["optimizer.name=sgd", "optimizer.lr=0.5", "optimizer.warmup=0"]


def test_sgd_fl_fsdp_every_step_equals_hsdp(tmp_path):
    """Averaging parameters after each SGD step = averaging gradients before it (A=1)."""
    _, hsdp, _ = sharded(tmp_path / "hsdp", "algorithm=hsdp", *SGD)
    _, fl_1, _ = sharded(tmp_path / "fl1", "algorithm=fl_fsdp", "algorithm.every=1", *SGD)
    assert_close(fl_1, hsdp, 1e-6)
    # ... and the check has teeth: with A=2 the groups drift apart between averages
    _, fl_2, _ = sharded(tmp_path / "fl2", "algorithm=fl_fsdp", "algorithm.every=2", *SGD)
    with pytest.raises(AssertionError):
        assert_close(fl_2, hsdp, 1e-6)


def test_the_moved_check_fails_when_no_step_changes_the_weights(tmp_path):
    """lr 0 (and so no weight decay either): ten steps, the weights stay at the run's initial ones."""
    _, params, _, initial = sharded(tmp_path, "algorithm=fsdp", "optimizer.lr=0", initial=True)
    assert not moved(params, initial)
