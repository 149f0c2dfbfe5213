"""Which outputs lose their bits at head dims 80/96 (dQ_single_wg config)?"""
import sys, torch
from tests.test_gpu_hopper import backward, problem
passes = int(sys.argv[1]) if len(sys.argv) > 1 else 300
for d in (96, 80, 64, 128):
    for hq, hkv in ((8, 8), (8, 2)):
        for schedule, causal in (("descending", True), ("shift", False), ("ascending", False)):
            p = problem(2, 2048, hq, hkv, d, causal, seed=2)
            ref = backward(p, schedule)
            bad = [0, 0, 0]
            for _ in range(passes):
                got = backward(p, schedule)
                for i in range(3):
                    bad[i] += not torch.equal(got[i], ref[i])
            print(f"hdim{d} {hq}/{hkv} {schedule} {'causal' if causal else 'full'}: mismatching dq/dk/dv {bad} of {passes}", flush=True)
