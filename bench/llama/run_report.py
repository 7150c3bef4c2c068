"""The report of one bench/llama_train_bench.py run: the ratios, muond vs torch and
muonium, each oriented so that > 1 means muond is faster, and the markdown table beside
the JSON that rank 0 writes (bench/README.md "The whole training step")."""
from __future__ import annotations

import json
import os

from llama_train_report import run_stem

OPTIMIZERS = ("muond", "torch", "muonium")


def ratio(a, b):
    return a / b if a and b else None


def ratios(results: dict) -> dict:
    r = {n: results.get(n) for n in OPTIMIZERS}
    tps = {n: (v or {}).get("tokens_per_s") for n, v in r.items()}
    opt = {n: (v or {}).get("opt_step_ms") for n, v in r.items()}
    return {"tokens_per_s_muond_over_torch": ratio(tps["muond"], tps["torch"]),
            "tokens_per_s_muond_over_muonium": ratio(tps["muond"], tps["muonium"]),
            "opt_ms_torch_over_muond": ratio(opt["torch"], opt["muond"]),
            "opt_ms_muonium_over_muond": ratio(opt["muonium"], opt["muond"])}


def fmt(v, spec=".2f", suffix=""):
    return "-" if v is None else f"{v:{spec}}{suffix}"


def gib(v) -> str:
    """GiB with two decimals, three significant digits below 1 (tiny model)."""
    return "-" if v is None else f"{v:.2f}" if v >= 1 else f"{v:.3g}"


def markdown(report: dict) -> str:
    c, lay = report["config"], report["layout"]
    m = report["model"]
    check = report.get("params_muond_vs_torch") or {}
    headline = []
    if check.get("verdict") == "MISMATCH":
        headline = [f"**MISMATCH**: muond's final params differ from torch's by "
                    f"{check['max_rel_diff']:.3e} ({check['worst']}) > --max-param-diff "
                    f"{check['max_param_diff']:g}.", ""]
    lines = [f"# Llama training step: {lay['parallel']}, {lay['world']} ranks "
             f"({lay['device']}, {lay['backend']})", "", *headline, "```", report["command"],
             "```", "",
             f"- model `{c['model']}`: d_model {m['d_model']}, {m['layers']} layers, "
             f"{m['heads']} heads / {m['kv_heads']} kv heads, ffn {m['ffn']}, vocab "
             f"{m['vocab']}; {m['params']['total'] / 1e6:,.1f}M params "
             f"({m['params']['block_matrices'] / 1e6:,.1f}M in block matrices -> Muon)",
             f"- mesh {lay['mesh']}; data parallel {lay['dp_size']}, tensor parallel "
             f"{lay['tp_size']}; {c['batch']} x {c['seq']} tokens per data-parallel rank, "
             f"{report['tokens_per_step']:,} per step; "
             f"{'bf16 autocast, ' if lay['device'] == 'cuda' else ''}fp32 params",
             f"- Muon lr {c['lr']}, momentum {c['momentum']} (Nesterov), wd "
             f"{c['weight_decay']}, {c['ns_steps']} NS steps; AdamW lr {c['adamw_lr']}, betas "
             f"{tuple(c['betas'])}, wd {c['adamw_weight_decay']}; {c['warmup']} warm-up + "
             f"{c['steps']} timed steps (median of the per-step max over ranks)", "",
             "| optimizer | tokens/s | step ms | fwd+bwd ms | opt step ms | opt share "
             "| loss first -> last | peak CUDA GiB, trainer | + muond daemon state "
             "(+ exchange peak) GiB | GPU in use, peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in c["optimizers"]:
        r = report["results"].get(name)
        if r is None:
            lines.append(f"| {name} | not run (below) |||||||||")
            continue
        daemon = "-"
        if r.get("daemon_state_gib") is not None:
            daemon = f"{gib(r['daemon_state_gib'])} (+{gib(r['daemon_transient_peak_gib'])})"
            if r.get("peak_cuda_with_daemon_gib") is not None:
                daemon += f" = {gib(r['peak_cuda_with_daemon_gib'])} per GPU"
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | "
                     f"{r['fwd_bwd_ms']:.1f} | {r['opt_step_ms']:.1f} | {r['opt_share']:.1%} | "
                     f"{r['loss_first']:.4f} -> {r['loss_last']:.4f} | "
                     f"{gib(r.get('peak_cuda_gib'))} | {daemon} | "
                     f"{gib(r.get('gpu_used_peak_gib'))} |")
    # A failed or skipped optimizer leaves its ratios out (None), never a KeyError
    # that would hide the failure and the table.
    q = ratios(report["results"])
    lines += ["", "Ratios oriented so that > 1 means muond is faster:", "",
              "| tokens/s muond ÷ torch | tokens/s muond ÷ muonium | opt ms torch ÷ muond "
              "| opt ms muonium ÷ muond |", "|---|---|---|---|",
              f"| {fmt(q['tokens_per_s_muond_over_torch'], '.3f')} | "
              f"{fmt(q['tokens_per_s_muond_over_muonium'], '.3f')} | "
              f"{fmt(q['opt_ms_torch_over_muond'], '.3f')} | "
              f"{fmt(q['opt_ms_muonium_over_muond'], '.3f')} |", "",
              "Peak CUDA memory is the trainer process's (max over ranks of "
              "torch.cuda.max_memory_allocated). muond keeps its optimizer state in the daemon "
              "process on the same GPU: its GetStatus state_bytes (momentum, AdamW moments) and "
              "exchange-buffer peak are the last column, with the sum per GPU (an upper bound: "
              "the peaks need not coincide; the daemon's staged momentum copy and NS workspace "
              "are not in it). torch's and muonium's state is in the trainer's number. GPU in "
              "use is the whole GPU's (cudaMemGetInfo, every process: the trainer's allocations "
              "and cache, the daemon's state, staging and workspaces), sampled every "
              "millisecond, above what was in use before the model was built.", ""]
    for name, note in report["notes"].items():
        if name in report["results"]:
            lines.append(f"- {name}: {note}")
    for name, why in report["skipped"].items():
        if why.startswith("FAILED"):  # tracebacks (Dynamo's run to 30 lines) kept verbatim
            lines += [f"- **{name} FAILED** (the rows above ran before it):", "", "```",
                      why.removeprefix("FAILED: ").strip(), "```", ""]
        else:
            lines.append(f"- {name} not run: {why}")
    for name in ("muond", "muonium"):
        cmp = report.get(f"params_{name}_vs_torch")
        if cmp:
            moved = cmp.get("worst_ref_change")
            lines += ["", f"Final params, {name} vs torch: max over tensors of ‖{name} − "
                          f"torch‖ / ‖torch‖ = **{cmp['max_rel_diff']:.3e}** ({cmp['worst']}"
                          + (f", which torch moved by {moved:.3e} of its norm from the init"
                             if moved is not None else "") + ")"
                          + (f"; the largest difference ÷ torch's movement of the same tensor "
                             f"is {cmp['max_diff_over_change']:.3e} ({cmp['worst_by_ratio']})"
                             if "max_diff_over_change" in cmp else "") + "."
                          + verdict_text(cmp)]
    muond = report["results"].get("muond")
    if muond and muond.get("plan"):
        plan = muond["plan"]
        lines += ["", "## muond: Newton–Schulz load per rank (coordinator's plan)", ""]
        if "error" in plan:
            lines.append(f"(plan unavailable: {plan['error']})")
        else:
            load = plan["rank_load"]
            total = sum(load) or 1.0
            lines += ["| rank | mesh | plan NS load | share | daemon NS ms (median) | "
                      "opt step ms (median) |", "|---|---|---|---|---|---|"]
            for r in muond["ranks"]:
                lines.append(f"| {r['rank']} | {r['mesh']} | {load[r['rank']]:.3g} | "
                             f"{load[r['rank']] / total:.1%} | "
                             f"{fmt(r.get('daemon_ns_ms_median'))} | "
                             f"{r['opt_step_ms_median']:.2f} |")
            lines += ["", f"Plan version {plan['version']}, groups {', '.join(plan['groups'])}; "
                          f"an even split gives each rank {1 / len(load):.1%}."]
    if muond and muond["ranks"][0].get("muond_phases_ms_median"):
        lines += phase_table(muond["ranks"], report["results"])
    if lay["device"] == "cpu":
        lines += ["", f"CPU run ({os.cpu_count()} cores shared by {lay['world']} trainers and "
                      "their daemons): a check that the job runs, not a speed comparison."]
    return "\n".join(lines) + "\n"


def phase_table(ranks: list, results: dict) -> list:
    """muond's opt step split per rank (medians, ms; the daemon's phases
    need not add up to its total: the commit vote and launches sit between
    them) and every optimizer's zero_grad GPU time (inside fwd+bwd)."""
    keys = list(ranks[0]["muond_phases_ms_median"])
    lines = ["", "## muond: where the optimizer step goes (median ms)", "",
             "| rank | " + " | ".join(keys) + " | zero_grad (GPU) |",
             "|---" * (len(keys) + 2) + "|"]
    for r in ranks:
        ph = r["muond_phases_ms_median"]
        lines.append(f"| {r['rank']} | " + " | ".join(f"{ph[k]:.2f}" for k in keys)
                     + f" | {fmt(r.get('zero_grad_ms_median'))} |")
    others = [f"{name} {fmt(res['ranks'][0].get('zero_grad_ms_median'))}"
              for name, res in results.items() if name != "muond"]
    if others:
        lines += ["", "zero_grad GPU ms on rank 0 for the others: " + ", ".join(others) + "."]
    return lines


def verdict_text(cmp: dict) -> str:
    """' **MISMATCH** ...' / ' Within ...' when --max-param-diff checked it."""
    if "verdict" not in cmp:
        return ""
    if cmp["verdict"] == "MISMATCH":
        return f" **MISMATCH**: above --max-param-diff {cmp['max_param_diff']:g}."
    return f" Within --max-param-diff {cmp['max_param_diff']:g}."


def write_outputs(report: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, run_stem(report["layout"]))
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(stem + ".md", "w") as f:
        f.write(text)
    return text
