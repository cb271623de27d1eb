"""What one GPU can show of the paper's path (NCCL, bf16 on GPU, fldp.init on CUDA, throughput).

    python experiments/gpu_check.py [--out DIR]      (or bash experiments/gpu_check.sh [DIR])

1. fldp.init on CUDA gives the same bits as on the CPU: every parameter of a tiny Llama, and the
   first 16M elements of the 8B model's widest parameters (embedding, an MLP projection).
2. Llama 3.1 8B in pure bf16 (parameters, gradients, AdamW state) on one rank through the real
   entry point (topology=gpu_1, NCCL, FSDP2 over one rank), the shipped corpus in 2,048-token blocks,
   batch 2: per-phase times, tokens/s and MFU beside torchtitan's published 5,762 tokens/s/GPU (Llama
   3.1 8B, FSDP2 bf16, 8 H100). On a GPU under ~120 GiB the 8B model with AdamW does not fit one
   rank: then half its layers run, and the report says so.
3. The tiny model trains on CUDA (the default recipe, FSDP on one GPU).
Budget: under 8 minutes on one H100/H200. Writes DIR/gpu_check.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fldp.init import standard_normal  # noqa: E402

TORCHTITAN_8B_H100 = 5762  # tokens/s/GPU, Llama 3.1 8B, FSDP2 bf16, 8 H100 (shared/anchors.md)
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s


def check_init() -> dict:
    from transformers import LlamaConfig  # noqa: F401

    from fldp.model import build_model, init_weights, llama_config

    out = {}
    for name, count in (("model.embed_tokens.weight", 1 << 24), ("model.layers.0.mlp.up_proj.weight", 1 << 24)):
        cpu = standard_normal(42, name, 0, count, "cpu")
        gpu = standard_normal(42, name, 0, count, "cuda").cpu()
        out[name] = {
            "elements": count,
            "differing": int((cpu != gpu).sum()),
            "max_abs_diff": float((cpu - gpu).abs().max()),
        }
    from omegaconf import OmegaConf

    tiny = OmegaConf.load(ROOT / "conf/model/tiny_llama.yaml")
    tiny.vocab_size = 4096
    models = {}
    for device in ("cpu", "cuda"):
        model = build_model(llama_config(tiny), "meta")
        init_weights(model, torch.device(device), 42)
        models[device] = {n: p.detach().cpu() for n, p in model.named_parameters()}
    out["tiny_llama"] = {
        "parameters": len(models["cpu"]),
        "identical": all(torch.equal(models["cpu"][n], models["cuda"][n]) for n in models["cpu"]),
    }
    return out


def train(out: Path, *overrides: str) -> tuple[list[dict], dict, float]:
    start = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "fldp.train",
        "algorithm=fsdp",
        "topology=gpu_1",
        "wandb.mode=disabled",
        "trainer.progress=false",
        "trainer.eval_batches=2",
        f"hydra.run.dir={out}",
        *overrides,
    ]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return (
        [r for r in rows if r.get("split") != "eval"],
        json.loads((out / "summary.json").read_text()),
        time.monotonic() - start,
    )


def flops_per_token(
    layers: int, hidden: int, intermediate: int, kv_heads: int, heads: int, vocab: int, seq: int
) -> float:
    """torchtitan's count: 6 x (non-embedding parameters, lm_head included) + 12 x layers x hidden x seq."""
    head_dim = hidden // heads
    attention = hidden * hidden * 2 + hidden * kv_heads * head_dim * 2
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    params = layers * per_layer + hidden + vocab * hidden
    return 6 * params + 12 * layers * hidden * seq


def check_8b(out: Path, steps: int, props) -> dict:
    """Llama 3.1 8B (half its layers where AdamW's full 8B does not fit) in pure bf16: each phase's
    mean time, tokens/s and MFU beside torchtitan's published H100 figure."""
    layers = 32 if props.total_memory > 120 * 2**30 else 16
    seq, batch = 2048, 2
    rows, _, wall = train(
        out / "llama3_1_8b",
        "model=llama3_1_8b",
        f"model.num_hidden_layers={layers}",
        "dataset.block_size=2048",
        f"trainer.steps={steps}",
        "trainer.precision=bf16",
        f"trainer.batch_size={batch}",
        "comm.measure=false",
    )
    timed = rows[2:]  # the first steps warm up allocator and kernels
    mean = {k: sum(r[f"time_{k}"] for r in timed) / len(timed) for k in ("forward", "backward", "optimizer", "step")}
    tokens_s = batch * seq / mean["step"]
    peak = next((v for k, v in PEAK_BF16.items() if k in props.name), None)
    fpt = flops_per_token(layers, 4096, 14336, 8, 32, 128256, seq)
    return {
        "layers": layers,
        "note": "" if layers == 32 else "half the layers: the full 8B with AdamW does not fit this GPU",
        "steps": len(rows),
        "timed_steps": len(timed),
        "phase_mean_s": mean,
        "tokens_per_s": tokens_s,
        "mfu": tokens_s * fpt / peak if peak else None,
        "torchtitan_tokens_per_s_h100": TORCHTITAN_8B_H100,
        "losses": [r["loss"] for r in rows],
        "wall_s": wall,
        "peak_memory_note": "see the run's log",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=f"outputs/gpu_check/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    report = {
        "device": props.name,
        "memory_gib": props.total_memory / 2**30,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    }
    print(json.dumps(report), flush=True)

    report["init"] = check_init()
    print("init cuda vs cpu:", json.dumps(report["init"]), flush=True)

    report["llama3_1_8b"] = check_8b(out, args.steps, props)
    print("8B:", json.dumps(report["llama3_1_8b"]), flush=True)

    rows, summary, wall = train(out / "tiny", "trainer.steps=24")
    report["tiny_llama"] = {
        "train_perplexity": summary["train_perplexity"],
        "eval_perplexity": summary["eval_perplexity"],
        "mean_step_s": sum(r["time_step"] for r in rows[1:]) / (len(rows) - 1),
        "wall_s": wall,
        "finite": all(math.isfinite(r["loss"]) for r in rows),
    }
    print("tiny:", json.dumps(report["tiny_llama"]), flush=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    ok = (
        report["init"]["tiny_llama"]["identical"]
        and all(v["differing"] == 0 for k, v in report["init"].items() if k != "tiny_llama")
        and report["tiny_llama"]["finite"]
    )
    print(f"gpu_check: {'ok' if ok else 'FAILED'}; {out / 'gpu_check.json'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
