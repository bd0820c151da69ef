"""The actor's sync view of FSDP2 parameters (trainer.actor.sync): the all-gather that bypasses
DTensor's dispatch must give exactly DTensor.full_tensor(), uneven and empty shards included,
and a one-rank mesh hands out its local tensors themselves (same object, same storage)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # dim-0 sizes 3 (uneven on 2 ranks), 1 (rank 1 holds no rows), 6 (even), and a 1-D bias
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1),
                               torch.nn.Linear(1, 6, bias=False))


def _rank(rank: int, world: int, port: int, errors) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from trainer.actor.sync import named_full_tensors, named_sync_tensors
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))  # gloo on CPU, GPU or not on this machine
        plain = _model()
        model = _model()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        views = dict(named_sync_tensors(model))
        ours = dict(named_full_tensors(model))
        theirs = {n: p.full_tensor() for n, p in model.named_parameters()}
        for n, p in plain.named_parameters():
            assert torch.equal(ours[n], theirs[n]) and torch.equal(ours[n], p.detach()), n
            assert ours[n].is_contiguous() and ours[n].shape == p.shape, n
            if world == 1:
                # the local tensor itself: same object every call, same storage as the shard
                local = dict(model.named_parameters())[n]._local_tensor
                assert views[n] is local and type(views[n]) is torch.Tensor, n
            else:
                assert hasattr(views[n], "full_tensor") and tuple(views[n].shape) == p.shape, n
        # both ranks reach here before either tears down: a rank leaving first made gloo
        # abort its peer (SIGABRT, exit -6) under a loaded CPU
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which asserts
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    # Every check passed: leave without the interpreter's teardown, where a gloo background
    # thread still joinable at exit made the C++ runtime abort (SIGABRT, "terminate called
    # without an active exception") under a loaded CPU, after the test had already succeeded.
    errors.close()
    errors.join_thread()
    os._exit(0)


def _run(world: int) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    from trainer.launch import free_port
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, errors)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    problems = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not problems and all(p.exitcode == 0 for p in procs), (problems,
                                                                 [p.exitcode for p in procs])


def test_gather_rows_equals_full_tensor_two_ranks():
    _run(2)


def test_one_rank_mesh_hands_out_local_tensors():
    _run(1)
