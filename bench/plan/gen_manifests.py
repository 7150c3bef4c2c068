"""Writes the param manifests under bench/manifests/ (full shapes, PyTorch
(out, in) order). Shapes: the models' published configs (hidden size, FFN size,
layers, attention and KV heads, head dim, experts) as the functions below spell them.
Usage: python3 bench/plan/gen_manifests.py   (from the repository root)"""
import json
import os

OUT = os.path.join(os.path.dirname(__file__), "..", "manifests")


def entry(name, shape, tp_dim, gtp=True):
    return {"name": name, "shape": list(shape), "tp_dim": tp_dim,
            "gtp_sharded": gtp}


def dense(prefix, layers, hidden, ffn, heads, kv_heads, head_dim):
    q, kv = heads * head_dim, kv_heads * head_dim
    params = []
    for l in range(layers):
        p = f"{prefix}layers.{l}."
        params += [
            entry(p + "self_attn.q_proj", (q, hidden), 0),
            entry(p + "self_attn.k_proj", (kv, hidden), 0),
            entry(p + "self_attn.v_proj", (kv, hidden), 0),
            entry(p + "self_attn.o_proj", (hidden, q), 1),
            entry(p + "mlp.gate_proj", (ffn, hidden), 0),
            entry(p + "mlp.up_proj", (ffn, hidden), 0),
            entry(p + "mlp.down_proj", (hidden, ffn), 1),
        ]
    return params


def qwen3_30b_a3b():
    hidden, expert_ffn, layers, experts = 2048, 768, 48, 128
    q, kv = 32 * 128, 4 * 128
    params = []
    for l in range(layers):
        p = f"layers.{l}."
        params += [
            entry(p + "self_attn.q_proj", (q, hidden), 0),
            entry(p + "self_attn.k_proj", (kv, hidden), 0),
            entry(p + "self_attn.v_proj", (kv, hidden), 0),
            entry(p + "self_attn.o_proj", (hidden, q), 1),
        ]
        # Experts: expert parallel, no expert TP (tp_dim -1), GTP-sharded.
        for e in range(experts):
            x = f"{p}mlp.experts.{e}."
            params += [
                entry(x + "gate_proj", (expert_ffn, hidden), -1),
                entry(x + "up_proj", (expert_ffn, hidden), -1),
                entry(x + "down_proj", (hidden, expert_ffn), -1),
            ]
    return params


def write(filename, model, source, params):
    path = os.path.join(OUT, filename)
    with open(path, "w") as f:
        f.write('{"model": %s,\n "source": %s,\n "params": [\n'
                % (json.dumps(model), json.dumps(source)))
        f.write(",\n".join("  " + json.dumps(p, separators=(",", ":"))
                           for p in params))
        f.write("\n]}\n")
    print(path, len(params))


if __name__ == "__main__":
    write("llama3_8b.json", "Llama-3-8B",
          "hidden 4096, FFN 14336, 32 layers, 32/8 heads of 128 (HF config)",
          dense("", 32, 4096, 14336, 32, 8, 128))
    write("llama3_70b.json", "Llama-3-70B",
          "hidden 8192, FFN 28672, 80 layers, 64/8 heads of 128 (HF config)",
          dense("", 80, 8192, 28672, 64, 8, 128))
    write("qwen3_30b_a3b.json", "Qwen3-30B-A3B",
          "hidden 2048, expert FFN 768, 48 layers, 128 experts, 32/4 heads "
          "of 128 (HF config); router and embeddings excluded",
          qwen3_30b_a3b())
    write("qwen3_1_7b.json", "Qwen3-1.7B",
          "hidden 2048, FFN 6144, 28 layers, 16/8 heads of 128 (HF config); "
          "embeddings excluded",
          dense("", 28, 2048, 6144, 16, 8, 128))
