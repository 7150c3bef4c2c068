"""A plain training script for local mode's tests: muond.torch.Muon with no
daemons=, run with no launcher or torchrun environment (or under a one-rank
`muond launch`). Steps a two-matrix model 3 times beside torch.optim.Muon
(Newton-Schulz in fp32 on both sides: torch_ns_fp32) and writes
OUT/info.json: the largest relative difference, the local cluster's server
and reaper pids and directory (none when launched); then ends as MODE says:

    python local_trainer.py MODE OUT

close     opt.close(); records which of those pids live and whether the
          directory exists afterwards ("after")
del       the same after `del opt` alone (no close(), no gc.collect())
exit      returns: the interpreter's exit stops the cluster
kill      after the first step writes info.json and sleeps until killed
shared    a second lease on the cluster (muond.local.acquire: another user)
          keeps it running after close(); releasing it stops it; then a
          second optimizer starts a fresh cluster and steps
launched  under `muond launch --nproc-per-node 1` without $RANK
off       $MUOND_LOCAL=0: records the error Muon() raises
daemon_killed  SIGKILLs the local daemon after the 3 steps: records the next
          step's error and whether the params changed; then close(), and a
          new optimizer starts a fresh cluster and steps
model     a model with biases and a LayerNorm through Muon(model.named_parameters())
          against torch.optim.Muon + torch.optim.AdamW ("groups", "rel_diff" per
          param); then as close
"""
import json
import os
import signal
import sys
import time

import torch

import muond.local
from muond.launch.processes import is_alive
from muond.torch import Muon
from torch_ns_fp32 import torch_muon_ns_in_fp32

HYPER = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
SHAPES = [(16, 8), (4, 16)]


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) / s[1] ** 0.5) for s in SHAPES]


def set_grads(ps, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)


def torch_step(opt):
    """torch.optim.Muon's step with its Newton-Schulz in fp32."""
    with torch_muon_ns_in_fp32():
        opt.step()


def rel_diff(got, want):
    return float((got - want).abs().max() / want.abs().max())


def cluster_facts():
    cluster = muond.local.current()
    if cluster is None:
        return {"pids": [], "directory": None}
    return {"pids": [s.proc.pid for s in cluster.servers] + [cluster.reaper.pid],
            "directory": cluster.directory}


def what_is_left(facts):
    return {"alive": [p for p in facts["pids"] if is_alive(p)],
            "directory_exists": bool(facts["directory"]) and os.path.exists(facts["directory"])}


def write(out, info):
    with open(os.path.join(out, "info.json.tmp"), "w") as f:
        json.dump(info, f)
    os.replace(os.path.join(out, "info.json.tmp"), os.path.join(out, "info.json"))


def train(out, mode):
    mine, ref = params(), params()
    opt = Muon(mine, fp32_matmul_prec="highest", **HYPER)
    reference = torch.optim.Muon(ref, **HYPER)
    facts = cluster_facts()
    for step in range(3):
        set_grads(mine, step)
        set_grads(ref, step)
        opt.step()
        torch_step(reference)
        if mode == "kill":
            write(out, facts)
            time.sleep(600)
    info = dict(facts, rel_diff=max(rel_diff(m.detach(), r.detach())
                                    for m, r in zip(mine, ref)))
    return opt, info


def small_model():
    """Linear layers with and without a bias and a LayerNorm: 2-D weights and
    1-D params, as every real model has."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4, bias=False))


def train_model():
    """README's one line, Muon(model.named_parameters(), ...), against
    torch.optim.Muon on the 2-D params and torch.optim.AdamW on the rest with
    the same hyperparameters (muond's AdamW defaults: betas (0.9, 0.95), eps
    1e-8); 3 steps of real backward passes."""
    mine, ref = small_model(), small_model()
    opt = Muon(mine.named_parameters(), fp32_matmul_prec="highest", **HYPER)
    matrices = [p for p in ref.parameters() if p.ndim == 2]
    others = [p for p in ref.parameters() if p.ndim != 2]
    torch_muon = torch.optim.Muon(matrices, **HYPER)
    torch_adamw = torch.optim.AdamW(others, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"],
                                    betas=(0.9, 0.95), eps=1e-8)
    data = torch.Generator().manual_seed(7)
    for _ in range(3):
        x, y = torch.randn(32, 8, generator=data), torch.randn(32, 4, generator=data)
        for net in (mine, ref):
            for p in net.parameters():
                p.grad = None
            torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        torch_step(torch_muon)
        torch_adamw.step()
    references = dict(ref.named_parameters())
    info = dict(cluster_facts(),
                groups=[[g["algorithm"], g["param_names"]] for g in opt.param_groups],
                rel_diff={name: rel_diff(p.detach(), references[name].detach())
                          for name, p in mine.named_parameters()})
    return opt, info


def shared(opt, info):
    """Another lease keeps the cluster; the last release stops it."""
    cluster = muond.local.current()
    other = muond.local.acquire(None, None, 30)
    opt.close()
    info["after_close_with_other_lease"] = what_is_left(info)
    other.release()
    info["after"] = what_is_left(info)
    second = Muon(params(), fp32_matmul_prec="highest", **HYPER)
    second_cluster = muond.local.current()
    info["second_is_fresh"] = second_cluster is not None and second_cluster is not cluster
    set_grads(second.param_groups[0]["params"], 0)
    second.step()
    info["second_stepped"] = second.step_id
    second_facts = cluster_facts()
    second.close()
    info["second_after"] = what_is_left(second_facts)


def daemon_killed(opt, info):
    """The step after the local daemon's death says so; a new optimizer
    after close() starts a fresh cluster."""
    daemon = next(s for s in muond.local.current().servers if s.rank == 0)
    os.kill(daemon.proc.pid, signal.SIGKILL)
    ps = opt.param_groups[0]["params"]
    before = [p.detach().clone() for p in ps]
    set_grads(ps, 3)
    try:
        opt.step()
        info["error"] = None
    except RuntimeError as e:
        info["error"] = str(e)
    info["unchanged"] = all(torch.equal(p.detach(), b) for p, b in zip(ps, before))
    info["daemon_pid"] = daemon.proc.pid
    opt.close()
    second = Muon(params(), fp32_matmul_prec="highest", **HYPER)
    set_grads(second.param_groups[0]["params"], 0)
    second.step()
    info["second_stepped"] = second.step_id
    second.close()


def main():
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "off":
        try:
            Muon(params(), **HYPER)
            write(out, {"error": None})
        except ValueError as e:
            write(out, {"error": str(e), "cluster": muond.local.current() is not None})
        return
    opt, info = train_model() if mode == "model" else train(out, mode)
    if mode in ("close", "model"):
        opt.close()
        info["after"] = what_is_left(info)
    elif mode == "del":
        del opt
        info["after"] = what_is_left(info)
    elif mode == "shared":
        shared(opt, info)
    elif mode == "daemon_killed":
        daemon_killed(opt, info)
    write(out, info)


if __name__ == "__main__":
    main()
