"""What unpadding once per forward (not once per layer) buys a Hugging Face model on a padded batch.

A Llama built from a config (no weights downloaded) with attn_implementation="dash", bf16, on the
GPU; a right-padded batch (lengths drawn between half and all of --seqlen). Times forward + backward
steps (synchronize + perf_counter around each), interleaving two variants round by round:

    once       the binding as shipped: the padding mask is unpadded by the first layer and the
               other layers reuse the indices and offsets tensors (one set of host syncs per forward)
    per_layer  every layer unpads again (nonzero, lengths, and the kernels' read of new offsets
               tensors: host syncs in every layer), as before the change

Prints the median step time of each and their ratio, and writes OUT_DIR/hf_padded_step.json.

    python3 scripts/gpu_hf_padded_step.py OUT_DIR [--layers 16] [--hidden 2048] [--seqlen 2048] [--batch 8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dash_plugin  # noqa: E402,F401  (registers "dash")
import dash_plugin.integrations.transformers as dash_hf  # noqa: E402


def build(args):
    import transformers
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 512,
        head_dim=128, max_position_embeddings=args.seqlen, attn_implementation="dash")
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()


def padded_batch(args):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.seqlen // 2, args.seqlen + 1, (args.batch,), generator=g)
    ids = torch.randint(3, 32000, (args.batch, args.seqlen), generator=g)
    mask = (torch.arange(args.seqlen)[None] < lengths[:, None]).long()
    return ids.cuda(), mask.cuda(), lengths.tolist()


def step(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    out.logits.float().mean().backward()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model = build(args)
    ids, mask, lengths = padded_batch(args)
    once = dash_hf._once_per_tensor
    variants = {"once": once, "per_layer": lambda kind, tensor, key, compute: compute()}
    times = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in (variants if r % 2 == 0 else reversed(list(variants))):
            dash_hf._once_per_tensor = variants[name]
            try:
                for i in range(args.steps + 2):
                    model.zero_grad(set_to_none=True)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step(model, ids, mask)
                    torch.cuda.synchronize()
                    if i >= 2:   # two warm-up steps per variant and round
                        times[name].append(time.perf_counter() - t0)
            finally:
                dash_hf._once_per_tensor = once
    result = {"gpu": torch.cuda.get_device_name(), "args": vars(args), "lengths": lengths,
              "attention": dash_plugin.last_resolved().describe(),
              "median_ms": {n: round(1e3 * statistics.median(t), 2) for n, t in times.items()},
              "steps_ms": {n: [round(1e3 * x, 2) for x in t] for n, t in times.items()}}
    med = result["median_ms"]
    print(f"{args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seqlen} (lengths {lengths}): "
          f"once {med['once']} ms, per layer {med['per_layer']} ms, per_layer / once "
          f"{med['per_layer'] / med['once']:.3f}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "hf_padded_step.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
