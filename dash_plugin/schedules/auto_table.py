"""Data for schedule='auto' (read by auto.py). First matching rule wins.

Keys: mask (full | causal | window: any sliding window, causal or not); head_dim_max and
seqlen_max (inclusive upper bounds, absent = any; seqlen is max(seqlen_q, seqlen_k), for varlen
the longest sequence); equal_lengths (True/False: seqlen_q == seqlen_k); varlen (True/False);
schedule (ascending | spt | descending | shift); source (why).

The initial entries come from the DAG model and the DASH authors' H800 measurements
(/work/shared/notes/dash-schedules.md section 7). The benchmark work replaces them with the
winners measured on our Triton kernels. The rule is a fixed table, never a timing taken at run
time, so every process picks the same schedule for the same shape.
"""

RULES = [
    dict(mask="window", schedule="descending",
         source="model: band masks have staggered row ranges; shift falls back to descending there"),
    dict(mask="causal", varlen=True, schedule="descending",
         source="symmetric shift needs equal lengths and an even tile count in every sequence"),
    dict(mask="causal", equal_lengths=False, schedule="descending",
         source="symmetric shift needs seqlen_q == seqlen_k (bottom-right alignment)"),
    dict(mask="causal", head_dim_max=64, seqlen_max=4096, schedule="shift",
         source="authors hdim64 causal <= 4k: shift 1.08/1.01/1.00/1.01x vs descending 0.97-1.01x"),
    dict(mask="causal", schedule="descending",
         source="authors causal: descending 1.02-1.03x (hdim64 >= 8k), 1.01-1.28x (hdim128)"),
    dict(mask="full", head_dim_max=64, seqlen_max=8192, schedule="shift",
         source="authors hdim64 full <= 8k: shift 1.08-1.18x (non-persistent); PR #2207 alike"),
    dict(mask="full", seqlen_max=8192, schedule="shift",
         source="authors hdim128 full <= 8k: shift 1.00-1.09x"),
    dict(mask="full", schedule="descending",
         source="authors full 16k: shift 0.96-0.99x, descending 1.01x (reduction cost negligible)"),
]
