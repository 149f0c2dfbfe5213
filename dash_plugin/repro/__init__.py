"""Tools that prove two training runs give identical bits.

- `data`: a byte-level dataset from the Python standard library's sources (on every machine, no download);
- `fingerprint`: exact scalars and on-device tensor digests logged per step;
- `compare`: the first step and the first tensors where two runs differ;
- `plot`: both loss curves overlaid and their difference;
- `cli`: the `dash-repro` command (run / compare / plot / demo), also `python -m dash_plugin.repro`.
"""
