#!/usr/bin/env bash
source out/setup.sh
T="tests/test_buffers.py"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -W ignore::DeprecationWarning -W ignore::UserWarning $T 2>&1 | tail -15 | tee $OUT/test_buffers.log
# mutation: the Triton backward accumulates dQ into a buffer it never zeroed; the NaN-filled run must show it
cp kernels/triton_backend.py /tmp/tb.py
python3 - <<'PY'
p = "kernels/triton_backend.py"
s = open(p).read()
old = "dqa = torch.zeros(q.shape, device=q.device, dtype=torch.float32)"
assert old in s
open(p, "w").write(s.replace(old, "dqa = buffers.empty(q.shape, torch.float32, q.device)"))
PY
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=line -W ignore::DeprecationWarning -W ignore::UserWarning $T -k "under_the_flag_give and triton and descending" 2>&1 | tail -8 | tee $OUT/test_buffers_mutant_unzeroed.log
cp /tmp/tb.py kernels/triton_backend.py
