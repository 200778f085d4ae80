#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Python's `safetensors` on mfsdp checkpoints (run by ckpt_check.py python, with the venv).

  ckpt_python.py ROOT REF FULL_PARAM FULL_FP32

REF holds what the saving job had (tests/mpi/test_ckpt.c collect()): per param, in manifest
order, numel fp32 master words then numel weight words (the param dtype's bits, widened to
32 bits). Checked bit for bit:
  - FULL_PARAM (export-full): every tensor, in its param dtype, is the trained weight;
  - FULL_FP32 (export-full --fp32): every tensor is the fp32 master;
  - the checkpoint's model files, opened through the index's weight_map the way
    transformers does, hold every weight whole;
  - the optim files' fp32 masters (non-fp32 params) and AdamW moments, reassembled from
    their "mfsdp.rows" metadata alone, have the right shapes and, for masters, the values.
"""
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bits(t):
    """The raw bits of a tensor as int64 (fp32 -> 32 bits, 16-bit types -> 16 bits)."""
    t = t.contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def main():
    root, ref, full_param, full_fp32 = sys.argv[1:5]
    name = open(os.path.join(root, "latest")).read().split()[0]
    ckpt = os.path.join(root, name)
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        index = json.load(f)
    manifest = index["mfsdp"]["manifest"]
    params = [p for g in manifest["groups"] for p in g["params"]]
    words = torch.frombuffer(bytearray(open(ref, "rb").read()), dtype=torch.int32)
    words = words.to(torch.int64) & 0xFFFFFFFF
    want_master, want_weight, off = {}, {}, 0
    for p in params:
        n = 1
        for d in p["shape"]:
            n *= d
        want_master[p["name"]] = words[off:off + n]
        want_weight[p["name"]] = words[off + n:off + 2 * n]
        off += 2 * n
    if off != words.numel():
        raise SystemExit(f"FAIL: {ref} has {words.numel()} words, the manifest needs {off}")

    checked = 0
    full = load_file(full_param)
    f32 = load_file(full_fp32)
    if set(full) != set(want_weight) or set(f32) != set(want_weight):
        raise SystemExit("FAIL: the exported files do not hold exactly the manifest's tensors")
    for p in params:
        nm, shape = p["name"], list(p["shape"])
        t = full[nm]
        if t.dtype != DT[p["dtype"]] or list(t.shape) != shape:
            raise SystemExit(f"FAIL: {nm}: {t.dtype} {list(t.shape)} in the export")
        if not torch.equal(bits(t).flatten(), want_weight[nm]):
            raise SystemExit(f"FAIL: {nm}: exported weight differs from the trained one")
        m = f32[nm]
        if m.dtype != torch.float32 or not torch.equal(bits(m).flatten(), want_master[nm]):
            raise SystemExit(f"FAIL: {nm}: exported fp32 master differs")
        checked += 2
    with safe_open(full_param, framework="pt") as f:
        meta = f.metadata()
    if meta.get("format") != "pt" or meta.get("mfsdp.format") != "mfsdp-full/1":
        raise SystemExit(f"FAIL: export metadata {meta}")

    # The model files through weight_map, one shard file at a time.
    files = {}
    for nm, fn in index["weight_map"].items():
        files.setdefault(fn, []).append(nm)
    for fn, names in sorted(files.items()):
        with safe_open(os.path.join(ckpt, fn), framework="pt") as f:
            if f.metadata().get("format") != "pt":
                raise SystemExit(f"FAIL: {fn}: no format=pt metadata")
            if sorted(f.keys()) != sorted(names):
                raise SystemExit(f"FAIL: {fn} holds {sorted(f.keys())}, weight_map says {names}")
            for nm in names:
                if not torch.equal(bits(f.get_tensor(nm)).flatten(), want_weight[nm]):
                    raise SystemExit(f"FAIL: {fn}: {nm} differs from the trained weight")
                checked += 1

    # Optimizer state: reassemble each state from the optim files' row metadata.
    pieces = {}
    world = index["mfsdp"]["world_size"]
    for r in range(world):
        fn = os.path.join(ckpt, f"optim-{r:05d}-of-{world:05d}.safetensors")
        with safe_open(fn, framework="pt") as f:
            rows = json.loads(f.metadata()["mfsdp.rows"])
            if sorted(rows) != sorted(f.keys()):
                raise SystemExit(f"FAIL: {fn}: mfsdp.rows does not list exactly its tensors")
            for key, (a, b) in rows.items():
                t = f.get_tensor(key)
                if t.shape[0] != b - a:
                    raise SystemExit(f"FAIL: {fn}: {key} has {t.shape[0]} rows, metadata {a}..{b}")
                pieces.setdefault(key, []).append((a, b, t))
    by_name = {p["name"]: p for p in params}
    for key, ps in sorted(pieces.items()):
        nm, state = key.rsplit(".", 1)
        p = by_name[nm]
        ps.sort(key=lambda x: x[0])
        whole = torch.cat([t for _, _, t in ps])
        if [a for a, _, _ in ps][0] != 0 or any(ps[i][1] != ps[i + 1][0]
                                                for i in range(len(ps) - 1)):
            raise SystemExit(f"FAIL: {key}: pieces do not tile the rows")
        if list(whole.shape) != list(p["shape"]) or whole.dtype != torch.float32:
            raise SystemExit(f"FAIL: {key}: reassembled {list(whole.shape)} {whole.dtype}")
        if state == "master" and not torch.equal(bits(whole).flatten(), want_master[nm]):
            raise SystemExit(f"FAIL: {key}: reassembled master differs from the trained one")
        checked += 1
    print(f"python safetensors {__import__('safetensors').__version__}: {checked} tensors "
          f"checked bitwise (full exports, {len(files)} model files via weight_map, "
          f"{len(pieces)} optimizer states reassembled from {world} optim files)")


if __name__ == "__main__":
    main()
