set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e .   # FA4 and the CuTe DSL on PYTHONPATH (carried wheels)
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
# The launcher: the Hopper forward without and with dropout, three calls each; ncu profiles
# the third without and the first with (--launch-skip 2 --launch-count 2).
cat > /tmp/ncu_forward_launch.py <<'PY'
"""Launches the Hopper forward without and with dropout (hdim, causal or full, seqlen from argv), three each, for ncu (ncu_forward.sh profiles the third without and the first with)."""
import sys, torch
sys.path.insert(0, ".")
from dash_plugin.kernels import hopper
hd, causal, s = int(sys.argv[1]), sys.argv[2] == "causal", int(sys.argv[3])
which = sys.argv[4] if len(sys.argv) > 4 else "fwd"
b, h = max(1, 16384 // s), 16
torch.manual_seed(0)
q, k, v, do = (torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(4))
from dash_plugin import dispatch
for p in (0.0, 0.1):
    for _ in range(3):
        out, lse = hopper.attention_forward(q, k, v, softmax_scale=hd ** -0.5, causal=causal, dropout_p=p, seed=7)
        if which == "bwd":
            dispatch.attention_backward(do, q, k, v, out, lse, softmax_scale=hd ** -0.5, causal=causal,
                                        schedule="descending", deterministic=True, backend="hopper", dropout_p=p, seed=7)
    torch.cuda.synchronize()
PY
for pt in "128 causal 8192" "128 full 2048" "64 causal 8192"; do
  echo "== $pt" | tee -a $OUT/ncu.log
  timeout 200 ncu --clock-control none --kernel-name regex:Forward --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    --metrics smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active \
    python3 /tmp/ncu_forward_launch.py $pt > $OUT/ncu_raw.txt 2>&1
  cat $OUT/ncu_raw.txt >> $OUT/ncu_full.log
  grep -E "Forward|Duration|Issue Slots|Executed Ipc|issue_active|inst_executed|Compute \(SM\) Throughput|No Eligible|Warp Cycles Per Issued|Stall" $OUT/ncu_raw.txt | sed 's/  */ /g' | tee -a $OUT/ncu.log
done
