"""`python -m fldp.group_step SPEC GROUP RESTART LIGHTHOUSE ROSTER`: one rank of an elastic run's
federation group, a task of the group's SLURM job step (started by fldp.elastic.run_slurm). Its
process group is the step's tasks, its rendezvous the step's first node (fldp.launch.rendezvous,
MASTER_PORT from the supervisor); SPEC is the pickled (config, run directory) of the run."""

from __future__ import annotations

import os
import pickle
import sys
import traceback


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from . import launch
    from .data import prepare
    from .elastic import Member, quiet_torchft
    from .train import _group_rank

    quiet_torchft()
    spec, group, restart, lighthouse, roster = argv
    with open(spec, "rb") as f:
        cfg, run_dir = pickle.load(f)
    env = os.environ
    rank = launch.RankEnv(
        int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"]), *launch.rendezvous(env)
    )
    os.environ.update(MASTER_ADDR=rank.master_addr, MASTER_PORT=str(rank.master_port))  # torchft's store too
    device = launch.init_process_group(rank, cfg.topology.device, cfg.cluster.timeout_s)
    blocks = prepare(cfg.dataset)  # the token cache the pre-flight found: read, not made
    _group_rank(cfg, run_dir, blocks, Member(int(group), int(restart), lighthouse, roster), device)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from .errors import NoPeerToHealFrom

    try:
        sys.exit(main(sys.argv[1:]))
    except NoPeerToHealFrom:  # back too late: the supervisor decides (fldp.elastic)
        os._exit(NoPeerToHealFrom.EXIT_CODE)
    except Exception:  # the supervisor reports the log's tail: the traceback first, before the peers' errors
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
