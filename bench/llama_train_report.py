#!/usr/bin/env python3
"""Merge bench/llama_train_bench.py's JSONs into one markdown table.

    python3 bench/llama_train_report.py out/llama [more dirs or .json files] > table.md

One row per layout x --inner x world size (a later file of the same run wins),
with each optimizer's tokens/s, step ms, optimizer share of the step and peak
memory, the ratios (tokens/s muond / torch and / muonium, opt step ms torch /
muond and muonium / muond: every ratio > 1 means muond is faster), muond's NS
load spread (max / mean of the plan's rank load) and the final-param
difference vs torch.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

LAYOUT_ORDER = ("ddp", "fsdp", "tp", "fsdp+tp", "hsdp")
OPTIMIZERS = ("muond", "torch", "muonium")


class InputError(Exception):
    """A path or file this script cannot use; the message names it."""


def run_stem(layout: dict) -> str:
    """A run's file name (without .json/.md) and identity: <parallel>-w<N>,
    <parallel>-i<inner>-w<N> for the 2-D layouts (fsdp+tp, hsdp), whose
    --inner changes the mesh. llama_train_bench.py names its outputs so."""
    inner = f"-i{layout['inner']}" if layout.get("inner") is not None else ""
    return f"{layout['parallel']}{inner}-w{layout['world']}"


def load(paths: list[str]) -> list[dict]:
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "*.json")))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise InputError(f"{p}: no such file or directory")
    runs = {}
    for f in files:
        try:
            with open(f) as fh:
                r = json.load(fh)
        except (OSError, ValueError) as e:
            raise InputError(f"{f}: not a readable JSON file ({e})") from None
        if isinstance(r, dict) and "layout" in r and "results" in r:
            runs[run_stem(r["layout"])] = r

    def order(r):
        lay = r["layout"]
        return (lay["world"], LAYOUT_ORDER.index(lay["parallel"]), lay.get("inner") or 0)
    return sorted(runs.values(), key=order)


def cell(v, spec):
    return "-" if v is None else format(v, spec)


def model_cell(r: dict) -> str:
    """Rows may differ in size (e.g. a 2-layer smoke run beside the whole 1b)."""
    m, c = r["model"], r["config"]
    total = m["params"]["total"]
    size = f"{total / 1e9:.2f}B" if total >= 1e8 else f"{total / 1e6:.2f}M"
    return (f"{c['model']} {m['layers']}L ({size}), "
            f"{c['warmup']}+{c['steps']} steps")


def short(why: str) -> str:
    """A peer's failure in one line: the exception's first line and the
    innermost frame of the traceback (Dynamo's reports run to 30 lines)."""
    lines = [ln.strip() for ln in why.splitlines() if ln.strip()]
    frames = [ln for ln in lines if ln.startswith("File ")]
    text = " ".join(lines[:2]) + (f" (at {frames[-1]})" if frames else "")
    return text if len(text) <= 400 else text[:397] + "..."


def optimizer_cell(r: dict | None) -> str:
    """tokens/s; step ms (optimizer share); peak GiB (the trainer's CUDA peak,
    + muond's daemon state and exchange peak where reported)."""
    if not r:
        return "-"
    text = f"{r['tokens_per_s']:,.0f}; {r['step_ms']:.1f} ms ({r['opt_share']:.1%})"
    peak = r.get("peak_cuda_gib")
    if peak is not None:
        text += f"; {peak:.1f} GiB"
        if r.get("daemon_state_gib") is not None:
            text += f" + {r['daemon_state_gib'] + r['daemon_transient_peak_gib']:.1f} daemon"
    return text


def params_cell(cmp: dict | None) -> str:
    """The largest relative difference, how far torch moved that tensor, and
    MISMATCH where the run's --max-param-diff was exceeded."""
    if not cmp:
        return "-"
    moved = cmp.get("worst_ref_change",  # older JSONs: from the per-tensor table
                    cmp.get("per_tensor", {}).get(cmp.get("worst"), {}).get("ref_change"))
    text = f"{cmp['max_rel_diff']:.2e}" + (f" (moved {moved:.2e})" if moved is not None else "")
    if cmp.get("verdict") == "MISMATCH":  # llama_train_bench.py --max-param-diff
        text += f" **MISMATCH** (> {cmp['max_param_diff']:g})"
    return text


def spread(result: dict | None):
    load = ((result or {}).get("plan") or {}).get("rank_load")
    if not load or not sum(load):
        return None
    return max(load) / (sum(load) / len(load))


def table(runs: list[dict]) -> str:
    head = ["layout", "world", "mesh", "model", "tokens/step", "NS muond/torch"]
    head += list(OPTIMIZERS)
    head += ["tok/s muond÷torch", "tok/s muond÷muonium", "opt ms torch÷muond",
             "opt ms muonium÷muond", "muond NS load max/mean", "params muond vs torch",
             "params muonium vs torch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = set()
    for r in runs:
        lay, res, q = r["layout"], r["results"], r.get("ratios", {})
        mesh = " x ".join(f"{k} {v}" for k, v in lay["mesh"].items())
        c = r["config"]
        prec = {"medium": "bf16", "high": "tf32", "highest": "fp32"}[c["muond_ns_precision"]]
        row = [lay["parallel"], str(lay["world"]), mesh, model_cell(r),
               f"{r['tokens_per_step']:,}",
               f"{prec}/{c.get('torch_ns_precision', 'bf16')}"]
        row += [optimizer_cell(res.get(n)) for n in OPTIMIZERS]
        row += [cell(q.get(k), ".3f") for k in (
            "tokens_per_s_muond_over_torch", "tokens_per_s_muond_over_muonium",
            "opt_ms_torch_over_muond", "opt_ms_muonium_over_muond")]
        row.append(cell(spread(res.get("muond")), ".3f"))
        row += [params_cell(r.get(f"params_{n}_vs_torch")) for n in ("muond", "muonium")]
        lines.append("| " + " | ".join(row) + " |")
        notes.update(f"{n} ({lay['parallel']}, world {lay['world']}): {short(why)}"
                     for n, why in r.get("skipped", {}).items())
    if runs:
        models = sorted({(r["config"]["model"], r["model"]["layers"], r["config"]["batch"],
                          r["config"]["seq"], r["layout"]["device"]) for r in runs})
        m = runs[0]["model"]
        lines += ["", f"Model shape d_model {m['d_model']}, {m['heads']}/{m['kv_heads']} heads, "
                      f"ffn {m['ffn']}, vocab {m['vocab']}; "
                      + "; ".join(f"`{name}` {layers} layers: {b} x {q} tokens per "
                                  f"data-parallel rank on {dev}"
                                  for name, layers, b, q, dev in models)
                      + ". Step times are medians of the per-step max over ranks.",
                  "",
                  "- Each optimizer's cell: tokens/s; step ms (optimizer share of the step); "
                  "peak CUDA GiB of the trainer process, max over ranks (muond: + its daemon's "
                  "reported state and exchange peak on the same GPU, which the trainer's number "
                  "does not include).",
                  "- Every ratio is oriented so that > 1 means muond is faster.",
                  "- params X vs torch: max over tensors of ‖X − torch‖ / ‖torch‖ after the run "
                  "(moved: ‖torch − init‖ / ‖init‖ of that same tensor)."]
        cpu = [r for r in runs if r["layout"]["device"] == "cpu"]
        if cpu:
            lines.append(f"- {'All' if len(cpu) == len(runs) else len(cpu)} CPU run"
                         f"{'s' if len(cpu) > 1 else ''}: a check that the job runs, not a "
                         "speed comparison.")
        lines += [f"- {n}" for n in sorted(notes)]
        lines += ["", "Commands:", ""] + [f"- `{r['command']}`" for r in runs]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="llama_train_report.py", description=__doc__.split("\n\n")[0],
        epilog="Every ratio in the table is oriented so that > 1 means muond is faster.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="llama_train_bench.py --out directories (their *.json) or JSON files")
    args = p.parse_args(argv)
    try:
        runs = load(args.paths)
    except InputError as e:
        print(f"llama_train_report.py: {e}", file=sys.stderr)
        return 2
    if not runs:
        print(f"llama_train_report.py: no llama_train_bench JSON in {' '.join(args.paths)}",
              file=sys.stderr)
        return 1
    sys.stdout.write(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
