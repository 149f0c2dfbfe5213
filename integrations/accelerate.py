"""Deterministic training set-up in one call, for Accelerate (and plain PyTorch) training loops.

Two runs of a training script give the same bits only when every source of run-to-run variation is pinned:
the seeds, the kernels PyTorch picks, the cuBLAS workspace, the order of the data and the seeds of the
dataloader workers. `setup_deterministic_training(seed)` pins all of them and returns a record of what it set,
so a training log can show it:

    setup = setup_deterministic_training(seed=0)
    print(setup.summary())
    accelerator = Accelerator(dataloader_config=setup.dataloader_config)
    loader = DataLoader(ds, shuffle=True, worker_init_fn=setup.worker_init_fn, generator=setup.generator())

What it cannot pin (the caller's job): the hardware, driver and library versions, the world size, NCCL's
algorithm choice on several GPUs (pin `NCCL_ALGO`), the number of CPU threads (CPU reductions may split work by
thread count) and `torch.compile`'s autotuning (`torch._inductor.config.deterministic`).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.utils.deterministic

# ":4096:8" is one of the two values cuBLAS documents for reproducible results (the other is ":16:8");
# the larger one keeps cuBLAS fast.
CUBLAS_WORKSPACE = ":4096:8"


def seed_worker(worker_id: int) -> None:
    """`worker_init_fn` for DataLoader workers: seed Python's and NumPy's RNGs from the worker's torch seed.

    PyTorch seeds each worker's torch RNG with base_seed + worker_id (base_seed drawn from the loader's
    generator), but leaves `random` and `numpy` alone, so a dataset that uses them would differ per run.

    This makes two runs from the start equal, not a resumed run: after `skip_first_batches` the remaining
    batches of the epoch go to other workers, whose RNGs have drawn for fewer items, so a dataset that draws
    random numbers per item gets others there. Such a dataset should seed each item from (epoch, index).
    """
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


@dataclass
class DeterministicSetup:
    """What `setup_deterministic_training` set, and the objects a training loop needs from it."""

    seed: int
    settings: dict[str, str] = field(default_factory=dict)  # what -> value, in the order they were set
    warnings: list[str] = field(default_factory=list)

    @property
    def dataloader_config(self):
        """Accelerate `DataLoaderConfiguration` with the seedable sampler on.

        With it, `accelerator.prepare(loader)` replaces a shuffling loader's RandomSampler by a
        SeedableRandomSampler whose permutation for epoch e is a function of (seed + e) only: the data
        order no longer depends on how much of the global RNG the run consumed before.
        """
        from accelerate import DataLoaderConfiguration

        return DataLoaderConfiguration(use_seedable_sampler=True, data_seed=self.seed)

    @property
    def worker_init_fn(self):
        return seed_worker

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with the run's seed, for `DataLoader(generator=...)`.

        The loader draws its workers' base seed from it instead of from the global RNG, so creating a
        loader iterator (one per epoch, and again on resume) leaves the global RNG untouched.
        """
        g = torch.Generator()
        g.manual_seed(self.seed)
        return g

    def summary(self) -> str:
        lines = [f"deterministic training set-up (seed {self.seed}):"]
        lines += [f"  {k} = {v}" for k, v in self.settings.items()]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def setup_deterministic_training(seed: int = 0, *, warn_only: bool = False, set_env: bool = True,
                                 fill_uninitialized_memory: bool = True) -> DeterministicSetup:
    """Pin every source of run-to-run variation this process controls, and say what was set.

    Args:
        seed: the seed for Python, NumPy, torch (CPU and all GPUs) and the data order.
        warn_only: passed to `torch.use_deterministic_algorithms`; False makes an op with no deterministic
            implementation raise instead of silently running nondeterministically.
        set_env: set CUBLAS_WORKSPACE_CONFIG and PYTHONHASHSEED (inherited by child processes and
            dataloader workers). An existing value is kept and reported.
        fill_uninitialized_memory: PyTorch's `torch.utils.deterministic.fill_uninitialized_memory`, which
            under `use_deterministic_algorithms` fills every new tensor from `torch.empty` with NaN (or the
            largest integer), so an op that reads memory it never wrote gives the same (and visible) result
            each run. That fill is what the flag costs a training step: 2.9-4.2 % of a 1B model's step on an
            H200 at 4k and 8k tokens; without it the deterministic step is within 1.0 % of the one with
            non-deterministic attention and the flag off (docs/benchmarks/e2e-2026-11-26-h200/). Our GPU
            attention kernels' own outputs and workspaces skip the fill either way (they write them before
            reading them; dash_plugin.kernels.buffers), which saves 0.4-0.6 % of that step
            (docs/benchmarks/buffers-fill-2026-11-26-h200/). False keeps every deterministic algorithm and
            drops the fill everywhere else too; the bits stay reproducible as long as no op reads memory it
            did not write (`dash-repro compare` checks two runs either way).
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed!r} is not allowed; pass an int in [0, 2**63)")
    # checked before anything is set, so a bad call changes nothing
    for name, value in (("warn_only", warn_only), ("set_env", set_env),
                        ("fill_uninitialized_memory", fill_uninitialized_memory)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is not allowed; pass True or False")
    setup = DeterministicSetup(seed=seed)
    s = setup.settings

    if set_env:
        # cuBLAS reads this when it creates its first handle; later changes have no effect.
        if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
        s["env CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
        if os.environ["CUBLAS_WORKSPACE_CONFIG"] not in (":4096:8", ":16:8"):   # the two cuBLAS documents
            setup.warnings.append(f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']!r} (set before) "
                                  "is kept, but cuBLAS is reproducible only with ':4096:8' or ':16:8'; torch "
                                  "refuses a deterministic CUDA matmul with any other value")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            setup.warnings.append("CUDA was initialised before the set-up; CUBLAS_WORKSPACE_CONFIG only takes "
                                  "effect if no cuBLAS handle exists yet (call this first)")
        # Only child processes see it (string hashing of this process is fixed at start-up).
        os.environ.setdefault("PYTHONHASHSEED", str(seed % 2**32))
        s["env PYTHONHASHSEED (children)"] = os.environ["PYTHONHASHSEED"]
        if os.environ["PYTHONHASHSEED"] != str(seed % 2**32):
            setup.warnings.append(f"PYTHONHASHSEED={os.environ['PYTHONHASHSEED']} (set before, e.g. by an earlier "
                                  f"call) is kept: child processes hash strings with it, not with seed {seed}")

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    numpy_seed = "" if seed < 2**32 else f" (numpy: {seed % 2**32}, seed mod 2**32)"
    s["seeds"] = f"random, numpy, torch (cpu{', cuda' if torch.cuda.is_available() else ''}) = {seed}{numpy_seed}"

    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    s["torch.use_deterministic_algorithms"] = f"True (warn_only={warn_only})"
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory
    ours = " (dash_plugin's GPU kernels skip it for their own buffers: written before read)"
    s["torch.utils.deterministic.fill_uninitialized_memory"] = str(fill_uninitialized_memory) + (
        ours if fill_uninitialized_memory else "")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False  # benchmarking picks algorithms by timing: never the same twice
    s["cudnn.deterministic / cudnn.benchmark"] = "True / False"

    s["dataloader sampler"] = f"accelerate SeedableRandomSampler, data_seed = {seed} (use .dataloader_config)"
    s["dataloader workers"] = "seed_worker seeds random/numpy from torch.initial_seed() (use .worker_init_fn)"
    s["dataloader generator"] = f"torch.Generator seeded {seed} (use .generator())"
    # Not set, but part of the bits on the CPU: reported so two logs can be compared.
    s["torch threads (not changed)"] = str(torch.get_num_threads())
    return setup
