#!/usr/bin/env bash
[ -d /tmp/site ] || { echo COLD; exit 7; }
source out/setup.sh
T="tests/test_buffers.py"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short -W ignore::DeprecationWarning -W ignore::UserWarning $T 2>&1 | tail -15 | tee $OUT/test_buffers.log
# mutation: keep every storage made under the flag (a leak); the GPU test must fail
python3 - <<'PY'
p = "kernels/buffers.py"
s = open(p).read()
s = s.replace("    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)",
              "    _LEAK.append(storage)\n    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, shape)") + "\n_LEAK = []\n"
open(p, "w").write(s)
PY
timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=line -W ignore::DeprecationWarning -W ignore::UserWarning $T -k under_the_flag 2>&1 | tail -8 | tee $OUT/test_buffers_mutant.log
git checkout kernels/buffers.py
