#!/usr/bin/env python3
"""Merge bench/llama_train_bench.py's JSONs into one markdown table.

    python3 bench/llama_train_report.py out/llama [more dirs or .json files] > table.md

One row per layout x world size (a later file of the same pair wins), with
each optimizer's tokens/s and optimizer share of the step, the ratios
(tokens/s muond / torch and / muonium, opt step ms torch / muond and
muonium / muond), muond's NS load spread (max / mean of the plan's rank load)
and the muond-vs-torch final-param difference.
"""
from __future__ import annotations

import glob
import json
import os
import sys

LAYOUT_ORDER = ("ddp", "fsdp", "tp", "fsdp+tp", "hsdp")
OPTIMIZERS = ("muond", "torch", "muonium")


def load(paths: list[str]) -> list[dict]:
    files = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
    runs = {}
    for f in files:
        with open(f) as fh:
            r = json.load(fh)
        if "layout" in r and "results" in r:
            runs[(r["layout"]["parallel"], r["layout"]["world"])] = r
    return [runs[k] for k in sorted(runs, key=lambda k: (k[1], LAYOUT_ORDER.index(k[0])))]


def cell(v, spec):
    return "-" if v is None else format(v, spec)


def model_cell(r: dict) -> str:
    """Rows may differ in size (e.g. a 2-layer smoke run beside the whole 1b)."""
    m, c = r["model"], r["config"]
    return (f"{c['model']} {m['layers']}L ({m['params']['total'] / 1e9:.2f}B), "
            f"{c['warmup']}+{c['steps']} steps")


def short(why: str) -> str:
    """A peer's failure in one line: the exception's first line and the
    innermost frame of the traceback (Dynamo's reports run to 30 lines)."""
    lines = [ln.strip() for ln in why.splitlines() if ln.strip()]
    frames = [ln for ln in lines if ln.startswith("File ")]
    text = " ".join(lines[:2]) + (f" (at {frames[-1]})" if frames else "")
    return text if len(text) <= 400 else text[:397] + "..."


def spread(result: dict | None):
    load = ((result or {}).get("plan") or {}).get("rank_load")
    if not load or not sum(load):
        return None
    return max(load) / (sum(load) / len(load))


def table(runs: list[dict]) -> str:
    head = ["layout", "world", "mesh", "model", "tokens/step", "NS muond/torch"]
    head += [f"{n} tok/s" for n in OPTIMIZERS] + [f"{n} opt share" for n in OPTIMIZERS]
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
        row += [cell((res.get(n) or {}).get("tokens_per_s"), ",.0f") for n in OPTIMIZERS]
        row += [cell((res.get(n) or {}).get("opt_share"), ".1%") for n in OPTIMIZERS]
        row += [cell(q.get(k), ".3f") for k in (
            "tokens_per_s_muond_over_torch", "tokens_per_s_muond_over_muonium",
            "opt_ms_torch_over_muond", "opt_ms_muonium_over_muond")]
        row.append(cell(spread(res.get("muond")), ".3f"))
        row += [cell((r.get(f"params_{n}_vs_torch") or {}).get("max_rel_diff"), ".2e")
                for n in ("muond", "muonium")]
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
                      + ". Step times are medians of the per-step max over ranks. params X vs "
                      "torch: max over tensors of ‖X − torch‖ / ‖torch‖ after the run."]
        lines += [f"- {n}" for n in sorted(notes)]
        lines += ["", "Commands:", ""] + [f"- `{r['command']}`" for r in runs]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    runs = load(argv)
    if not runs:
        print(f"llama_train_report.py: no llama_train_bench JSON in {' '.join(argv)}",
              file=sys.stderr)
        return 1
    sys.stdout.write(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
