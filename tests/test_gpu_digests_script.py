"""scripts/gpu_digests.py on the CPU (the reference path): the JSON it writes and its --compare."""
import json

from tests.script_modules import load_script


def _load():
    return load_script("gpu_digests")


def test_digests_and_compare(tmp_path, capsys):
    digests = _load()
    out = tmp_path / "a.json"
    assert digests.main(["--device", "cpu", "--cases", "varlen_causal_d64", "--schedules", "ascending,atomic",
                         "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["digests"]) == {"varlen_causal_d64/ascending", "varlen_causal_d64/atomic"}
    entry = data["digests"]["varlen_causal_d64/ascending"]
    assert entry["stable"] and all(len(entry[n]) == 64 for n in digests.TENSORS)
    assert "backend=auto -> reference" in entry["resolved"]
    assert digests.main(["--compare", str(out), str(out)]) == 0
    entry["dk"] = "0" * 64
    data["digests"]["varlen_causal_d64/atomic"]["dq"] = "0" * 64    # atomic's dq is not compared
    changed = tmp_path / "b.json"
    changed.write_text(json.dumps(data))
    capsys.readouterr()
    assert digests.main(["--compare", str(out), str(changed)]) == 1
    text = capsys.readouterr().out
    assert "varlen_causal_d64/ascending: DIFFERENT: dk" in text
    assert "varlen_causal_d64/atomic: equal (atomic: dq not compared)" in text
