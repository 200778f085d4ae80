#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate the reference manifests of examples/models/ (mfsdp-manifest/1, docs/manifest.md).

Usage: scripts/gen-models.py [OUTDIR]   (default: examples/models next to this script)

Shapes are nn.Linear-style (out_features, in_features), the order FSDP2 sees them: groups in
all-gather order (the root group's params are gathered first), params in registration order.
No world_size is written, so every manifest works at any world size. The output is
deterministic: rerunning the script must leave `git diff` empty.
"""
import json
import os
import sys

FORMAT = "mfsdp-manifest/1"


def param(name, shape, dtype, **extra):
    p = {"name": name, "shape": list(shape), "dtype": dtype}
    p.update(extra)
    return p


def group(name, params, **extra):
    g = {"name": name}
    g.update(extra)
    g["params"] = params
    return g


def dumps(manifest):
    """Compact JSON: top-level keys one per line, one group header per line, one param per line."""
    out = ["{"]
    keys = list(manifest.keys())
    for k in keys:
        last = k == keys[-1]
        v = manifest[k]
        if k == "groups":
            out.append('  "groups": [')
            for gi, g in enumerate(v):
                head = {key: val for key, val in g.items() if key != "params"}
                head_txt = json.dumps(head)[:-1]
                out.append("    " + head_txt + ', "params": [')
                for pi, p in enumerate(g["params"]):
                    comma = "," if pi + 1 < len(g["params"]) else ""
                    out.append("      " + json.dumps(p) + comma)
                out.append("    ]}" + ("," if gi + 1 < len(v) else ""))
            out.append("  ]" + ("" if last else ","))
        elif k == "sequence":
            out.append('  "sequence": [')
            for i, call in enumerate(v):
                out.append("    " + json.dumps(call) + ("," if i + 1 < len(v) else ""))
            out.append("  ]" + ("" if last else ","))
        else:
            out.append("  %s: %s%s" % (json.dumps(k), json.dumps(v), "" if last else ","))
    out.append("}")
    return "\n".join(out) + "\n"


def tiny():
    """Two small blocks and a root group; odd shapes, 1-D, 3-D, frozen and mixed-dtype params."""
    root = group("root", [
        param("embed.weight", [37, 24], "float32"),           # adamw by name
        param("norm.weight", [24], "float32"),                # 1-D: adamw
        param("lm_head.weight", [37, 24], "float32"),         # adamw by name
    ])
    blocks = []
    for b in range(2):
        pre = "blocks.%d." % b
        if b == 0:
            # bfloat16 and float32 in one group: FSDP2 gathers it as bytes and needs a
            # reduce dtype for the gradients.
            params = [
                param(pre + "attn.qkv.weight", [30, 24], "bfloat16", split=[10, 10, 10]),
                param(pre + "attn.qkv.bias", [30], "bfloat16"),
                param(pre + "attn.proj.weight", [24, 10], "float32"),
                param(pre + "fc1.weight", [50, 24], "bfloat16"),
                param(pre + "fc1.bias", [50], "float32"),
                param(pre + "fc2.weight", [24, 50], "float32"),
            ]
            blocks.append(group("blocks.0", params, reduce_dtype="float32"))
        else:
            params = [
                param(pre + "conv.weight", [6, 3, 5], "float32"),   # 3-D: muon on a 6x15 view
                param(pre + "fc1.weight", [50, 24], "float32"),
                param(pre + "fc1.bias", [50], "float32"),
                param(pre + "fc2.weight", [24, 50], "float32", optimizer="adamw"),
                param(pre + "scale", [7], "float32", requires_grad=False),
                param(pre + "gate.weight", [3, 24], "float32", requires_grad=False),
            ]
            blocks.append(group("blocks.1", params, lr_scale=0.5, weight_decay=0.01))
    # One iteration with reshard_after_forward: forward gathers root then the blocks; the
    # backward gathers each block again and reduces it; the root reduces last.
    sequence = [
        ["allgather", "root"], ["allgather", "blocks.0"], ["allgather", "blocks.1"],
        ["allgather", "blocks.1"], ["reduce_scatter", "blocks.1"],
        ["allgather", "blocks.0"], ["reduce_scatter", "blocks.0"],
        ["reduce_scatter", "root"],
    ]
    return {
        "format": FORMAT,
        "optimizer": {"lr": 0.02, "momentum": 0.95, "nesterov": True, "ns_steps": 5,
                      "weight_decay": 0.0, "scale": "keller",
                      "adamw": {"lr": 0.001, "betas": [0.9, 0.95], "eps": 1e-8,
                                "weight_decay": 0.0}},
        "groups": [root] + blocks,
        "sequence": sequence,
    }


def gpt2_124m():
    """GPT-2 small (nanoGPT naming, Linear orientation); lm_head is tied to wte, so absent."""
    d, vocab, ctx, layers, dt = 768, 50257, 1024, 12, "float32"
    root = group("root", [
        param("transformer.wte.weight", [vocab, d], dt),
        param("transformer.wpe.weight", [ctx, d], dt),
        param("transformer.ln_f.weight", [d], dt),
        param("transformer.ln_f.bias", [d], dt),
    ])
    groups = [root]
    for i in range(layers):
        pre = "transformer.h.%d." % i
        groups.append(group("h.%d" % i, [
            param(pre + "ln_1.weight", [d], dt),
            param(pre + "ln_1.bias", [d], dt),
            param(pre + "attn.c_attn.weight", [3 * d, d], dt, split=[d, d, d]),
            param(pre + "attn.c_attn.bias", [3 * d], dt),
            param(pre + "attn.c_proj.weight", [d, d], dt),
            param(pre + "attn.c_proj.bias", [d], dt),
            param(pre + "ln_2.weight", [d], dt),
            param(pre + "ln_2.bias", [d], dt),
            param(pre + "mlp.c_fc.weight", [4 * d, d], dt),
            param(pre + "mlp.c_fc.bias", [4 * d], dt),
            param(pre + "mlp.c_proj.weight", [d, 4 * d], dt),
            param(pre + "mlp.c_proj.bias", [d], dt),
        ]))
    return {"format": FORMAT, "groups": groups}


def llama3(hidden, ffn, layers, vocab=128256, kv=8 * 128, dt="bfloat16"):
    """Llama-3 (Hugging Face naming): GQA with 8 KV heads of dim 128, untied lm_head.
    Scaled-down variants change the vocabulary, the KV width and the dtype."""
    root = group("root", [
        param("model.embed_tokens.weight", [vocab, hidden], dt),
        param("model.norm.weight", [hidden], dt),
        param("lm_head.weight", [vocab, hidden], dt),
    ], reduce_dtype="float32")
    groups = [root]
    for i in range(layers):
        pre = "model.layers.%d." % i
        groups.append(group("layers.%d" % i, [
            param(pre + "self_attn.q_proj.weight", [hidden, hidden], dt),
            param(pre + "self_attn.k_proj.weight", [kv, hidden], dt),
            param(pre + "self_attn.v_proj.weight", [kv, hidden], dt),
            param(pre + "self_attn.o_proj.weight", [hidden, hidden], dt),
            param(pre + "mlp.gate_proj.weight", [ffn, hidden], dt),
            param(pre + "mlp.up_proj.weight", [ffn, hidden], dt),
            param(pre + "mlp.down_proj.weight", [hidden, ffn], dt),
            param(pre + "input_layernorm.weight", [hidden], dt),
            param(pre + "post_attention_layernorm.weight", [hidden], dt),
        ], reduce_dtype="float32"))
    return {"format": FORMAT, "groups": groups}


MODELS = {
    "tiny.json": tiny,
    "gpt2-124m.json": gpt2_124m,
    "llama3-8b.json": lambda: llama3(4096, 14336, 32),
    "llama3-70b.json": lambda: llama3(8192, 28672, 80),
    # Scaled-down Llama (4 blocks, hidden 1024, FFN 3584): mfsdp-perf optstep's manifest.
    "llama-mini.json": lambda: llama3(1024, 3584, 4),
    # Small fp32 Llama (2 blocks, hidden 512, FFN 1792, 4 KV heads of 64, vocabulary 1024):
    # mfsdp-perf trainstep's manifest, small enough for its forward/backward GEMMs at 8k
    # tokens per rank on a CPU.
    "llama-small.json": lambda: llama3(512, 1792, 2, vocab=1024, kv=4 * 64, dt="float32"),
    # The same layout at toy size (hidden 64, FFN 176): the trainstep tests.
    "llama-tiny.json": lambda: llama3(64, 176, 2, vocab=96, kv=2 * 16, dt="float32"),
}


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "examples", "models")
    os.makedirs(outdir, exist_ok=True)
    for fname, make in MODELS.items():
        manifest = make()
        text = dumps(manifest)
        assert json.loads(text) == manifest, fname  # the compact writer loses nothing
        numel = 0
        for g in manifest["groups"]:
            for p in g["params"]:
                n = 1
                for d in p["shape"]:
                    n *= d
                numel += n
        path = os.path.join(outdir, fname)
        with open(path, "w") as f:
            f.write(text)
        print("%-16s %4d groups %5d params %15d elements" % (
            fname, len(manifest["groups"]),
            sum(len(g["params"]) for g in manifest["groups"]), numel))


if __name__ == "__main__":
    main()
