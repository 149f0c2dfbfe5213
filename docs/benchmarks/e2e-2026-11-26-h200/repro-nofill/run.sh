source out/setup.sh
set -o pipefail
timeout 250 dash-repro run --out $OUT/small-nofill --size small --seq-len 1024 --steps 100 --no-nan-fill 2>&1 | grep -v "Warning\|exe_args" | tail -8; echo "rc=$?"
timeout 300 dash-repro run --out $OUT/1b-hd128-nofill --size 1b-hd128 --seq-len 4096 --batch-size 2 --steps 20 --no-nan-fill 2>&1 | grep -v "Warning\|exe_args" | tail -8; echo "rc=$?"
grep -h "fill_uninitialized" $OUT/*/run1/*.log 2>/dev/null | head -2; ls $OUT/small-nofill $OUT/small-nofill/run1 | head -20
find $OUT -name "*.safetensors" -o -name "*.pt" -o -name "*.bin" | xargs -r rm -f
