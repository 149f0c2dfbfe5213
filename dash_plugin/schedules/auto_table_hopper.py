"""Data for schedule='auto' on the Hopper backend (read by auto.py before the generic rules of
auto_table.py, which then cover what these do not: window, varlen, unequal lengths, and head
dims the Hopper kernel lacks, all of which run on the Triton backend). First matching rule wins;
keys as in auto_table.py.

Measured with scripts/gpu_hopper_bwd.py on an NVIDIA H100 80GB HBM3 (132 SMs, torch 2.11.0+cu130,
flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1), 2026-11-23, one process, backward TFLOP/s:
docs/benchmarks/hopper-bwd-2026-11-23-h100/closed-form/. A fixed table, never a timing taken at
run time.
"""

RULES = [
    {'mask': 'causal', 'head_dim_max': 64, 'seqlen_max': 1024, 'schedule': 'ascending',
     'source': 'measured H100 hdim64 causal s=1024: ascending 265.4, spt 256.8, descending 248.9'},
    {'mask': 'causal', 'head_dim_max': 64, 'schedule': 'spt',
     'source': 'measured H100 hdim64 causal s=2k/4k/8k/16k: spt 363.9/422.0/462.2/497.6, '
               'descending 334.4/409.9/440.4/450.0, ascending 348.9/391.9/408.9/453.5'},
    {'mask': 'causal', 'seqlen_max': 1024, 'schedule': 'ascending',
     'source': 'measured H100 hdim128 causal s=1024: ascending 274.7, descending 264.0, spt 244.6 '
               '(GQA 4:1: spt 225.5, ascending 223.5, descending 222.4); hdim96: inferred from hdim128'},
    {'mask': 'causal', 'schedule': 'descending',
     'source': 'measured H100 hdim128 causal s=2k/4k/8k/16k: descending 368.8/447.0/499.6/536.5, '
               'spt 342.0/422.3/491.6/526.7, ascending 354.3/404.1/442.2/452.5 (GQA 4:1 from 4k: '
               'descending 414.6/484.6/522.2, spt 403.0/472.0/509.1); hdim96: inferred from hdim128'},
    {'mask': 'full', 'schedule': 'ascending',
     'source': 'measured H100 full hdim64/128 s=1k-16k: ascending within 1% of spt or ahead at every '
               'point (hdim128 16k: ascending 581.8, spt 569.5, descending 507.9, shift 360.9)'},
]
