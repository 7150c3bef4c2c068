"""The trainer ranks of test_megatron_adapter.py: TP 2 x DP 2 on 4 gloo
processes, each running ``main`` once and putting its results on a queue."""
from __future__ import annotations

import io
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_trainer as mt  # noqa: E402

import torch  # noqa: E402

TP = 2
STEPS, MORE, BF16_STEPS = 4, 2, 3


def muond_optimizer(model, env, name, **config):
    from muond.megatron import get_megatron_optimizer
    return get_megatron_optimizer(mt.optimizer_config(**config), [model],
                                  daemons=[env["daemon"]],
                                  job_id=env["job_id"], token=env["token"],
                                  shard_mode="local", name=name)


def save(model, opt, path):
    from megatron.core import dist_checkpointing
    model_sd = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_sd,
                             "optimizer": opt.sharded_state_dict(model_sd)}, path)


def load(model, opt, path):
    from megatron.core import dist_checkpointing
    model_sd = model.sharded_state_dict()
    loaded = dist_checkpointing.load(
        {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)},
        path)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def blockwise_warns(env) -> bool:
    """LayerShardedMuon with tp_mode='blockwise' over a TP group of 2 warns
    that muond's update is the full-matrix one (construction registers
    nothing: no daemon is asked)."""
    import warnings
    from megatron.core import parallel_state
    from muond.megatron import LayerShardedMuon
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = LayerShardedMuon([torch.nn.Parameter(torch.zeros(4, 4))], tp_mode="blockwise",
                               tp_group=parallel_state.get_tensor_model_parallel_group(),
                               daemons=[env["daemon"]], job_id=env["job_id"],
                               token=env["token"], shard_mode="local", name="blockwise")
    opt.close()
    return any("blockwise" in str(w.message) for w in caught)


def refusal_on_one_rank(rank, muon) -> str:
    """set_group_process_groups refused on rank 1 alone (a group index it
    does not have): every rank raises, naming rank 1, and nothing changes."""
    from megatron.core import parallel_state
    tp = parallel_state.get_tensor_model_parallel_group()
    try:
        muon.set_group_process_groups({7: (None, tp)} if rank == 1 else {0: (None, tp)})
    except ValueError as e:
        return str(e)
    return "not refused"


def expert_bucket(env, megatron_get_optimizer) -> dict:
    """A param Megatron treats as expert-parallel (allreduce=False) puts a
    second Muon in the chain, without a QKV param while split_qkv is on (as
    Megatron builds it): both Muons are muond's, named apart, and train as
    Megatron's own."""
    out = {}
    for kind in ("megatron", "muond"):
        model = mt.build_model()
        model.decoder.layers[0].mlp.linear_fc1.weight.allreduce = False
        opt = (megatron_get_optimizer(mt.optimizer_config(), [model]) if kind == "megatron"
               else muond_optimizer(model, env, "moe"))
        mt.train(model, opt, 0, 2)
        out[kind] = mt.full_params(model)
        if kind == "muond":
            muons = [o.optimizer for o in opt.chained_optimizers
                     if type(o.optimizer).__name__ == "LayerShardedMuon"]
            out["names"] = [m.name for m in muons]
            for m in muons:
                m.close()
    return out


def expert_parallel(rank, env) -> dict:
    """Megatron-LM's own case for set_group_process_groups: a dense group
    whose params differ per rank (no process group: every rank its own
    domain, as in the seed) and an expert group sharded by rows over an
    expert GTP group {0, 1}, {2, 3} whose pairs hold different experts.
    Against Megatron's TensorParallelMuon on the whole matrices, in this
    process: the max relative difference of each after 2 steps."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon
    from muond.megatron import LayerShardedMuon
    kw = mt.SEED_MUON_OPTIONS
    egtp, _ = torch.distributed.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    pair, g = rank // 2, rank % 2
    gen = torch.Generator().manual_seed(50 + pair)
    full_expert = torch.randn(16, 8, generator=gen)
    expert_grads = [torch.randn(16, 8, generator=gen) for _ in range(2)]
    gen = torch.Generator().manual_seed(60 + rank)
    full_dense = torch.randn(8, 8, generator=gen)
    dense_grads = [torch.randn(8, 8, generator=gen) for _ in range(2)]
    rows = slice(8 * g, 8 * (g + 1))
    expert = torch.nn.Parameter(full_expert[rows].clone())
    expert.is_gtp_weight_remat = True
    dense = torch.nn.Parameter(full_dense.clone())
    opt = LayerShardedMuon([{"params": [dense]}, {"params": [expert]}],
                           gtp_remat_group=None, daemons=[env["daemon"]], job_id=env["job_id"],
                           token=env["token"], shard_mode="local", name="ep", **kw)
    opt.set_group_process_groups({1: (egtp, None)})
    ref_params = [torch.nn.Parameter(full_dense.clone()), torch.nn.Parameter(full_expert.clone())]
    ref = TensorParallelMuon(ref_params, **kw)
    for step in range(2):
        dense.grad, expert.grad = dense_grads[step].clone(), expert_grads[step][rows].clone()
        ref_params[0].grad, ref_params[1].grad = dense_grads[step].clone(), expert_grads[step]
        opt.step()
        ref.step()
    opt.close()
    rel = mt.rel_diff
    return {"dense": rel(dense.detach(), ref_params[0].detach()),
            "expert": rel(expert.detach(), ref_params[1].detach()[rows]),
            "moved": rel(expert.detach(), full_expert[rows])}


def collective_refusals(rank, env) -> dict:
    """What every rank raises when one rank's call is refused (no rank may
    wait for a timeout), and that a re-placement refused after steps leaves
    the optimizer stepping with its state. The messages, per case."""
    from megatron.core import parallel_state
    from muond.megatron import LayerShardedMuon
    tp = parallel_state.get_tensor_model_parallel_group()
    out = {}

    def fresh(name):
        torch.manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8, 8))]
        opt = LayerShardedMuon([{"params": params[:1]}, {"params": params[1:]}], lr=0.02,
                               daemons=[env["daemon"]], job_id=env["job_id"],
                               token=env["token"], shard_mode="local", name=name)
        return params, opt

    def attempt(key, call):
        try:
            call()
            out[key] = "not refused"
        except (TypeError, ValueError) as e:
            out[key] = str(e)

    def step(params, opt):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()

    params, opt = fresh("refusals-a")  # not registered yet
    attempt("before_first_step", lambda: opt.set_group_process_groups(
        {7: (None, tp)} if rank == 1 else {1: (None, tp)}))
    attempt("different_groups", lambda: opt.set_group_process_groups(
        {} if rank == 1 else {1: (None, tp)}))
    step(params, opt)
    momentum = opt.state_dict()["state"][1]["momentum_buffer"].clone()
    # Valid on each rank, refused by the placement (the same group as both
    # axes): undone, registered again as before.
    attempt("refused_by_placement", lambda: opt.set_group_process_groups({1: (tp, tp)}))
    out["state_kept"] = torch.equal(opt.state_dict()["state"][1]["momentum_buffer"], momentum)
    attempt("add_param_group", lambda: opt.add_param_group(
        {"params": [torch.nn.Parameter(torch.zeros(4) if rank == 1 else torch.zeros(4, 8))]}))
    # A fixed entry edited on rank 1 alone: step()'s refusal, raised by either
    # re-registration on every rank before any of them unregisters.
    kept = opt.param_groups[0]["ns_steps"]
    if rank == 1:
        opt.param_groups[0]["ns_steps"] = kept + 1
    attempt("changed_fixed_add", lambda: opt.add_param_group(
        {"params": [torch.nn.Parameter(torch.zeros(4, 8))]}))
    attempt("changed_fixed_replace", lambda: opt.set_group_process_groups({1: (None, tp)}))
    opt.param_groups[0]["ns_steps"] = kept
    step(params, opt)
    out["steps_after"] = opt.step_id
    opt.close()
    return out


def scenario(rank, env) -> dict:
    from megatron.core.optimizer import get_megatron_optimizer as megatron_get_optimizer
    out = {"blockwise_warned": blockwise_warns(env), "expert_parallel": expert_parallel(rank, env),
           "collective_refusals": collective_refusals(rank, env)}
    # Megatron's own Muon (TensorParallelMuon, duplicated: full-matrix NS).
    model = mt.build_model()
    out["initial"] = mt.full_params(model)
    opt = megatron_get_optimizer(mt.optimizer_config(), [model])
    out["megatron_losses"] = mt.train(model, opt, 0, STEPS)
    out["megatron"] = mt.full_params(model)
    save(model, opt, env["megatron_checkpoint"])
    mt.train(model, opt, STEPS, 1)
    out["megatron_next"] = mt.full_params(model)
    # The same through muond: one line differs.
    model = mt.build_model()
    opt = muond_optimizer(model, env, "megatron-a")
    out["kinds"] = [type(o.optimizer).__name__ for o in opt.chained_optimizers]
    out["muond_losses"] = mt.train(model, opt, 0, STEPS)
    out["muond"] = mt.full_params(model)
    # dist_checkpointing: save, go on; resume in a new optimizer, go on.
    path = env["checkpoint"]
    save(model, opt, path)
    mt.train(model, opt, STEPS, MORE)
    out["continued"] = mt.full_params(model)
    out["refusal"] = refusal_on_one_rank(rank, opt.chained_optimizers[0].optimizer)
    opt.chained_optimizers[0].optimizer.close()
    model = mt.build_model(seed=99)  # other values: all must come from the checkpoint
    opt = muond_optimizer(model, env, "megatron-b")
    load(model, opt, path)
    mt.train(model, opt, STEPS, MORE)
    out["resumed"] = mt.full_params(model)
    opt.chained_optimizers[0].optimizer.close()
    out["expert_bucket"] = expert_bucket(env, megatron_get_optimizer)
    # Megatron's own checkpoint resumed by muond (the same state names).
    model = mt.build_model(seed=5)
    opt = muond_optimizer(model, env, "megatron-migrated")
    load(model, opt, env["megatron_checkpoint"])
    mt.train(model, opt, STEPS, 1)
    out["migrated_next"] = mt.full_params(model)
    opt.chained_optimizers[0].optimizer.close()
    # bf16 params: Megatron's mixed-precision wrapper (fp32 main params,
    # swapped in after the Muon part is built) on both sides.
    model = mt.build_model(bf16=True)
    opt = megatron_get_optimizer(mt.optimizer_config(bf16=True), [model])
    mt.train(model, opt, 0, BF16_STEPS)
    out["megatron_bf16"] = mt.full_params(model)
    model = mt.build_model(bf16=True)
    out["bf16_initial"] = mt.full_params(model)
    opt = muond_optimizer(model, env, "megatron-bf16", bf16=True)
    out["bf16_kinds"] = [type(o).__name__ for o in opt.chained_optimizers]
    mt.train(model, opt, 0, BF16_STEPS)
    out["muond_bf16"] = mt.full_params(model)
    opt.chained_optimizers[0].optimizer.close()
    # Resharded: TP 1 x DP 4 from the TP 2 x DP 2 checkpoint.
    mt.reset_parallel(1)
    model = mt.build_model(seed=7)
    opt = muond_optimizer(model, env, "megatron-c")
    load(model, opt, path)
    out["resharded_loaded"] = mt.full_params(model)
    mt.train(model, opt, STEPS, MORE)
    out["resharded"] = mt.full_params(model)
    opt.chained_optimizers[0].optimizer.close()
    return out if rank == 0 else {"rank": rank}


def main(rank, world, port, env, results):
    try:
        mt.init(rank, world, port, TP)
        # By value (torch.save's bytes): tensors pickled by torch's
        # multiprocessing reductions would need this process alive until read.
        buffer = io.BytesIO()
        torch.save(scenario(rank, env), buffer)
        results.put((rank, buffer.getvalue(), None))
    except BaseException:  # noqa: BLE001 (reported to the test)
        results.put((rank, None, traceback.format_exc()))
