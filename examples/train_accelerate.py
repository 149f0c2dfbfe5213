"""Train a Llama-style byte-level language model with Accelerate and fingerprint every step.

The model is built from a config (no download), uses `attn_implementation="dash"` by default, and learns to
predict the bytes of the Python standard library's source files, which every machine has. Each step appends one
JSON line to OUT/steps.jsonl: the loss as an exact hex float, the gradient norm, the learning rate, tokens/s, MFU
and a digest of every parameter (as the step saw it) and every gradient. The final weights are saved with
safetensors and hashed. `dash-repro compare` finds the first step where two such runs differ.

    python examples/train_accelerate.py --size tiny --steps 30 --out runs/a
    python examples/train_accelerate.py --size tiny --steps 30 --stop-at 10 --out runs/b      # saves runs/b/checkpoint
    python examples/train_accelerate.py --size tiny --steps 30 --resume-from runs/b/checkpoint --out runs/c
    accelerate launch --num_processes 2 examples/train_accelerate.py --size small --steps 50 --out runs/ddp

Sizes: see --help (--size). On a GPU the default mixed precision is bf16.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

# Model sizes: (layers, hidden, heads, kv heads, MLP width, default sequence length, default batch size).
# Head dims are 32 (tiny, small), 64 (base, 1b) or 128 (1b-hd128: the 1b model's widths with the head dim of most
# current LLMs, where the orders of the Hopper backend differ most from FA4's), inside the kernels' range of 1..256.
SIZES = {
    "tiny": (2, 64, 2, 1, 256, 128, 8),
    "small": (4, 256, 8, 4, 1024, 256, 8),
    "base": (12, 768, 12, 4, 2048, 1024, 8),
    "1b": (16, 2048, 32, 8, 8192, 2048, 4),
    "1b-hd128": (16, 2048, 16, 4, 8192, 2048, 4),
}
SIZE_USE = {"tiny": "the CPU demo", "small": "a CPU (slow at long sequences) or a GPU", "base": "one GPU",
            "1b": "one GPU with bf16", "1b-hd128": "one GPU with bf16"}


def n_params(size: str) -> int:
    """Parameters of a size: embeddings and lm_head (256 bytes each), per layer q/k/v/o, the gated MLP and two
    norms, and the final norm (the same count LlamaForCausalLM gives)."""
    layers, hidden, heads, kv, mlp, _, _ = SIZES[size]
    kv_width = kv * (hidden // heads)
    per_layer = 2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * mlp + 2 * hidden
    return layers * per_layer + 2 * 256 * hidden + hidden


def describe_sizes() -> str:
    """One line per size, for --help."""
    lines = []
    for name, (layers, hidden, heads, kv, mlp, seq, batch) in SIZES.items():
        lines.append(f"{name}: {layers} layers, hidden {hidden}, {heads} heads ({kv} KV), MLP {mlp}, "
                     f"{n_params(name) / 1e6:.3g}M parameters, default --seq-len {seq} and --batch-size {batch}; "
                     f"for {SIZE_USE[name]}")
    return "; ".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (steps.jsonl, meta.json, final weights)")
    p.add_argument("--size", choices=list(SIZES), default="tiny",
                   help=f"model size (default %(default)s). {describe_sizes()}")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps to run in total (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens (bytes) per sequence (default: per size)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step and process (default: per size)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of AdamW (default %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="linear warm-up steps before the cosine decay")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the data order and all RNGs")
    p.add_argument("--attn", default="dash", help='attn_implementation (default "dash"; "sdpa", "eager" to compare)')
    p.add_argument("--schedule", default=None,
                   help="dash backward schedule, set through dash_plugin.configure (atomic = nondeterministic)")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
                   help="default: bf16 on a GPU, no on the CPU")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if a GPU is present")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (fixes CPU reduction splits)")
    p.add_argument("--data-bytes", type=int, default=None,
                   help="bytes of stdlib source to use (default: enough for the run, at least 1 MB)")
    p.add_argument("--num-workers", type=int, default=0, help="dataloader worker processes")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step and save a checkpoint")
    p.add_argument("--resume-from", default=None, help="checkpoint directory written by --stop-at")
    p.add_argument("--perturb", default=None, metavar="STEP:PARAM",
                   help="test aid: flip the lowest bit of element 0 of PARAM just before STEP (1-based)")
    p.add_argument("--no-nan-fill", action="store_true",
                   help="keep torch.use_deterministic_algorithms but not its NaN fill of new memory (3-4 %% of a "
                        "1B model's GPU step; see setup_deterministic_training)")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    args = p.parse_args(argv)
    layers, hidden, heads, kv, mlp, seq, batch = SIZES[args.size]
    args.seq_len = seq if args.seq_len is None else args.seq_len   # 0 is refused below, not replaced
    args.batch_size = batch if args.batch_size is None else args.batch_size
    for name in ("steps", "seq_len", "batch_size", "threads", "data_bytes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')}={value} is not allowed; pass a positive integer")
    if args.num_workers < 0:
        p.error(f"--num-workers={args.num_workers} is not allowed; pass 0 or more")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed={args.seed} is not allowed; pass an integer in 0..2**63-1")
    if not args.lr > 0 or args.warmup < 0:
        p.error(f"--lr={args.lr} / --warmup={args.warmup} are not allowed; pass a learning rate > 0 and "
                "warm-up steps >= 0")
    if args.schedule is not None:
        from dash_plugin.schedules import registry
        allowed = (registry.AUTO,) + registry.names()
        if args.schedule not in allowed:
            p.error(f"--schedule={args.schedule!r} is not allowed; pass one of {', '.join(allowed)}")
    if args.stop_at is not None and not 1 <= args.stop_at <= args.steps:
        p.error(f"--stop-at={args.stop_at} is not allowed; pass a step in 1..--steps ({args.steps})")
    if args.perturb is not None:
        step, _, name = args.perturb.partition(":")
        if not step.isdigit() or not name:
            p.error(f"--perturb={args.perturb!r} is not allowed; use STEP:PARAM_NAME, e.g. 3:model.norm.weight")
        if not 1 <= int(step) <= args.steps:  # a step that never comes would perturb nothing, silently
            p.error(f"--perturb={args.perturb!r} is not allowed; its STEP must be in 1..--steps ({args.steps})")
        args.perturb = (int(step), name)
    return args


def build_model(args, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from dash_plugin.repro.data import VOCAB_SIZE

    layers, hidden, heads, kv, mlp, _, _ = SIZES[args.size]
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=mlp,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                         max_position_embeddings=args.seq_len, tie_word_embeddings=False,
                         attention_dropout=0.0, use_cache=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    config._attn_implementation = attn
    torch.manual_seed(args.seed)  # the initial weights depend on the seed only
    return LlamaForCausalLM(config)


def lr_at(step: int, args) -> float:
    """Linear warm-up then cosine decay to 10%: a pure function of the step, so resuming needs no state."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def configure_attention(args) -> dict:
    """Import dash_plugin (registers "dash") and apply --schedule. Returns what was set, for meta.json."""
    import dash_plugin

    if args.schedule is None:
        return {}
    if not hasattr(dash_plugin, "configure"):
        raise SystemExit("--schedule needs dash_plugin.configure, which this dash_plugin does not have")
    deterministic = args.schedule != "atomic"  # atomic is the one nondeterministic schedule
    dash_plugin.configure(schedule=args.schedule, deterministic=deterministic)
    return {"schedule": args.schedule, "deterministic": deterministic}


def batches(loader, accelerator, epoch: int, skip: int):
    """Endless (epoch, index-in-epoch, batch) stream. An epoch's order depends on (seed + epoch) only
    (seedable sampler), so a resumed run sets the epoch and skips the batches it has already seen."""
    while True:
        loader.set_epoch(epoch)
        source = accelerator.skip_first_batches(loader, skip) if skip else loader
        for i, batch in enumerate(source, start=skip):
            yield epoch, i, batch
        epoch, skip = epoch + 1, 0


def save_checkpoint(path: Path, accelerator, model, optimizer, step, epoch, index, steps_log: Path, args):
    """Everything needed to continue bit-identically: weights (safetensors), optimizer, RNG states,
    data position, and the steps logged so far (so the resumed run's log is complete)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    rank = accelerator.process_index
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    torch.save(rng, path / f"rng_{rank}.pt")
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
        torch.save(optimizer.state_dict(), path / "optimizer.pt")
        (path / "state.json").write_text(json.dumps(
            {"step": step, "epoch": epoch, "next_index": index + 1, "args": vars_for_json(args)}, indent=1))
        shutil.copy(steps_log, path / "steps.jsonl")
    accelerator.wait_for_everyone()


def read_checkpoint_state(path: Path, rank: int) -> dict:
    """state.json of a --resume-from checkpoint, after checking that all its files are there; SystemExit
    naming the directory or file otherwise."""
    from dash_plugin.repro.fingerprint import RunFileError, read_json

    if not path.is_dir():
        raise SystemExit(f"--resume-from {path}: no such checkpoint directory (--stop-at K writes OUT/checkpoint)")
    files = ["state.json", "model.safetensors", "optimizer.pt", f"rng_{rank}.pt", "steps.jsonl"]
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise SystemExit(f"--resume-from {path}: not a complete checkpoint, missing {', '.join(missing)}")
    try:
        state = read_json(path / "state.json")
    except RunFileError as e:
        raise SystemExit(f"--resume-from: {e}") from None
    keys = {"step", "epoch", "next_index", "args"}
    if not isinstance(state, dict) or not keys <= set(state):
        raise SystemExit(f"--resume-from: {path / 'state.json'} must be an object with {', '.join(sorted(keys))}")
    return state


def _load_part(path: Path, load):
    """load(path), or SystemExit naming the file: a damaged checkpoint must say which of its files is bad."""
    try:
        return load(path)
    except Exception as e:  # safetensors, torch.load and load_state_dict raise many different types
        raise SystemExit(f"--resume-from: {path} cannot be loaded ({type(e).__name__}: {e})") from None


def load_checkpoint(path: Path, accelerator, model, optimizer) -> None:
    from safetensors.torch import load_file

    module = accelerator.unwrap_model(model)
    _load_part(path / "model.safetensors", lambda p: module.load_state_dict(load_file(p)))
    _load_part(path / "optimizer.pt", lambda p: optimizer.load_state_dict(torch.load(p, weights_only=False)))
    rng = _load_part(path / f"rng_{accelerator.process_index}.pt", lambda p: torch.load(p, weights_only=False))
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def vars_for_json(args) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}


def check_resume_args(saved: dict, args) -> None:
    """A resumed run must be the same training: only the output and stop/resume/progress flags may change."""
    free = {"out", "stop_at", "resume_from", "progress"}
    now = vars_for_json(args)
    diff = {k: (saved.get(k), now.get(k)) for k in now if k not in free and saved.get(k) != now.get(k)}
    if diff:
        raise SystemExit(f"--resume-from: the checkpoint was written with other arguments: {diff}")


def main(argv=None) -> int:
    args = parse_args(argv)
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from dash_plugin.integrations.accelerate import setup_deterministic_training
    from dash_plugin.repro.data import ByteBlocks, stdlib_corpus
    from dash_plugin.repro.fingerprint import (GradOrder, clear_final, exact, grad_digests, param_digests,
                                               peak_flops, train_flops_per_token, write_jsonl)

    if args.threads:
        torch.set_num_threads(args.threads)
    # first: before CUDA creates a cuBLAS handle
    setup = setup_deterministic_training(args.seed, fill_uninitialized_memory=not args.no_nan_fill)
    attn_config = configure_attention(args)
    use_cpu = args.cpu or not torch.cuda.is_available()
    mixed = args.mixed_precision or ("no" if use_cpu else "bf16")
    accelerator = Accelerator(cpu=use_cpu, mixed_precision=mixed, dataloader_config=setup.dataloader_config)
    out = Path(args.out)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        clear_final(out)
        print(setup.summary(), flush=True)

    # Data: enough bytes for every step to see a fresh block (plus the validation share), at least 1 MB.
    world = accelerator.num_processes
    need = int(args.steps * args.batch_size * world * args.seq_len * 1.1) + args.seq_len * 40
    corpus = stdlib_corpus(args.data_bytes or max(need, 1 << 20))
    train_set = ByteBlocks(corpus, args.seq_len, "train")
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.num_workers, worker_init_fn=setup.worker_init_fn,
                        generator=setup.generator())

    model = build_model(args, args.attn)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  foreach=True)  # not fused: one well-defined kernel sequence everywhere
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if (args.stop_at or args.resume_from) and accelerator.distributed_type.name.startswith("FSDP"):
        # The checkpoint keeps one full copy of the optimizer state (right for one process and for DDP,
        # where it is replicated); FSDP shards it, which this example does not save.
        raise SystemExit("--stop-at/--resume-from support one process and DDP, not FSDP")
    # Digests by name from the unwrapped module: its parameters are the ones DDP trains.
    named = list(accelerator.unwrap_model(model).named_parameters())
    names = [n for n, _ in named]
    if args.perturb and args.perturb[1] not in names:  # now, not when its step comes
        raise SystemExit(f"--perturb: no parameter named {args.perturb[1]!r}; parameters: {', '.join(names)}")

    start_step, epoch, index = 0, 0, 0
    steps_log = out / "steps.jsonl"
    if args.resume_from:
        ckpt = Path(args.resume_from)
        state = read_checkpoint_state(ckpt, accelerator.process_index)
        check_resume_args(state["args"], args)  # before loading: weights of another size would not fit
        load_checkpoint(ckpt, accelerator, model, optimizer)
        start_step, epoch, index = state["step"], state["epoch"], state["next_index"]
        if args.stop_at is not None and args.stop_at <= start_step:
            # The loop would never reach it: the run would train to the end and save neither weights nor checkpoint.
            raise SystemExit(f"--stop-at={args.stop_at} is not allowed with --resume-from {ckpt}, which continues "
                             f"after step {start_step}; pass a step in {start_step + 1}..--steps ({args.steps}), "
                             f"or no --stop-at")
        if accelerator.is_main_process:
            shutil.copy(ckpt / "steps.jsonl", steps_log)
    elif accelerator.is_main_process:
        steps_log.write_text("")

    device = accelerator.device
    flops_per_token = train_flops_per_token(n_params - n_embed, SIZES[args.size][0], SIZES[args.size][1],
                                            args.seq_len)
    peak = peak_flops(device)
    if accelerator.is_main_process:
        meta = {"args": vars_for_json(args), "attention": attn_config, "device": str(device),
                "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "num_processes": world, "mixed_precision": mixed, "n_params": n_params,
                "data_sha256": train_set.sha256, "train_blocks": len(train_set),
                "torch": torch.__version__, "python": sys.version.split()[0],
                "determinism": setup.settings, "param_names": names}
        (out / "meta.json").write_text(json.dumps(meta, indent=1))

    bar = None
    if args.progress and accelerator.is_main_process:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=start_step, desc=f"train {out.name}", unit="step")
    log = open(steps_log, "a") if accelerator.is_main_process else None
    stream = batches(loader, accelerator, epoch, index)
    model.train()
    for step in range(start_step + 1, args.steps + 1):
        epoch, index, batch = next(stream)
        for g in optimizer.param_groups:
            g["lr"] = lr_at(step - 1, args)
        if args.perturb and args.perturb[0] == step:
            perturb(accelerator.unwrap_model(model), args.perturb[1])
        params_seen = param_digests(named)  # the weights this step's forward uses

        watch = GradOrder(named) if step == start_step + 1 else None
        t0 = time.perf_counter()
        loss = model(**batch).loss
        accelerator.backward(loss)
        sync(device)
        t1 = time.perf_counter()
        # Before clipping: the gradients as the backward made them. Clipping scales all of them by one
        # factor of the total norm (logged as grad_norm), so a difference anywhere would show everywhere.
        grads = grad_digests(named)
        t2 = time.perf_counter()
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # The run's loss: every process's loss gathered (exact) and averaged in rank order.
        losses = accelerator.gather(loss.detach().float().reshape(1))
        loss_value = losses.double().mean() if world > 1 else losses[0]
        sync(device)
        seconds = (t1 - t0) + (time.perf_counter() - t2)  # digests excluded from the speed
        tokens = args.batch_size * args.seq_len * world
        if log is not None:
            write_jsonl(log, {
                "step": step, "epoch": epoch, "batch": index,
                "loss": exact(loss_value), "grad_norm": exact(grad_norm), "lr": exact(lr_at(step - 1, args)),
                "loss_float": float(loss_value), "tokens_per_s": tokens / seconds,
                "mfu": tokens * flops_per_token / seconds / (peak * world) if peak else None,
                "params": params_seen, "grads": grads})
        if watch is not None:
            order = watch.finish()
            if accelerator.is_main_process:
                if order:   # where the difference entered, for dash-repro compare
                    meta["grad_order"] = order
                if args.attn == "dash":
                    # Record what the attention actually resolved to (schedule, determinism, and who decided).
                    import dash_plugin

                    resolved = dash_plugin.last_resolved()
                    meta["dash_resolved"] = resolved.describe() if resolved is not None else None
                (out / "meta.json").write_text(json.dumps(meta, indent=1))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss_value):.4f}")
        if args.stop_at == step:
            save_checkpoint(out / "checkpoint", accelerator, model, optimizer, step, epoch, index, steps_log, args)
            if accelerator.is_main_process:
                print(f"stopped at step {step} of {args.steps}; checkpoint in {out / 'checkpoint'} "
                      f"(continue with --resume-from {out / 'checkpoint'} --out NEW_DIR)", flush=True)
            break
    if bar is not None:
        bar.close()
    if log is not None:
        log.close()

    if args.stop_at is None or args.stop_at == args.steps:
        save_final(out, accelerator, model)
    accelerator.end_training()
    return 0


def perturb(model, name: str) -> None:
    """Flip the lowest bit of element 0 of one parameter (the smallest change a float can see)."""
    params = dict(model.named_parameters())
    if name not in params:
        raise SystemExit(f"--perturb: no parameter named {name!r}; parameters: {', '.join(params)}")
    with torch.no_grad():
        flat = params[name].data.view(-1)
        bits = flat[:1].view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        bits ^= 1


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save_final(out: Path, accelerator, model) -> None:
    """The final weights (model.safetensors) and final.json (the file's sha256, a digest per tensor)."""
    from dash_plugin.repro.fingerprint import write_final

    state = accelerator.get_state_dict(model)  # the full state on the main process, also under FSDP
    if accelerator.is_main_process:
        write_final(out, state)
    accelerator.wait_for_everyone()

if __name__ == "__main__":
    sys.exit(main())
