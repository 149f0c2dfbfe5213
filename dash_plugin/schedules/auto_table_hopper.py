"""Data for schedule='auto' on the Hopper backend (read by auto.py before the generic rules of
auto_table.py, which then cover what these do not: head dims the Hopper kernel lacks, and calls
that run on the Triton backend). First matching rule wins; keys as in auto_table.py, plus
head_dim_min (an inclusive lower bound; the head dims 192/256 rules). The head-dim ranges are the
kernel's tile ranges (a head dim off its table runs at the next one's tiles: tile_table.py), so a
rule measured at 64, 128, 192 or 256 holds for the head dims that share those tiles, checked at
32, 80 and 160. Head dims 33-56 are the exception: at hdim 64's tiles their padded columns make
a step short against the ordered dQ add, and other orders win there (measured at 40, 48 and 56).

Measured with scripts/gpu_hopper_bwd.py on an NVIDIA H100 80GB HBM3 (132 SMs, torch 2.11.0+cu130,
flash-attn-4 4.0.0b36, nvidia-cutlass-dsl 4.8.1), 2026-11-23 to 11-26, one process, backward TFLOP/s:
docs/benchmarks/hopper-bwd-2026-11-23-h100/closed-form/, for the shift rows
docs/benchmarks/hopper-shift-2026-11-23-h100/ (the full hdim128 rule also from
docs/benchmarks/shift-writer-2026-11-24-h100/), for the hdim128 causal row
docs/benchmarks/dq-readahead-2026-11-23-h100/. A fixed table, never a timing taken at
run time.
"""

RULES = [
    # Head dims 200-256 (64 x 48 tiles, measured at 256), scripts/gpu_hopper_bwd.py, docs/benchmarks/wide-heads-2026-11-24-h100/
    # (median of 2 interleaved rounds). Also packed batches: arrival does not run them at these tiles.
    # Head dims 136-192 (64 x 96 tiles, measured at 192) follow the hdim 128 rules below, which
    # its figures confirm.
    {'mask': 'causal', 'head_dim_min': 193, 'schedule': 'spt',
     'source': 'measured H100 hdim256 causal s=2k/8k: spt 222.4/262.8, descending 198.8/231.8, '
               'arrival 195.1/233.0 (8k: its fallback), ascending 182.2/208.7'},
    {'mask': 'full', 'head_dim_min': 193, 'schedule': 'ascending',
     'source': 'measured H100 hdim256 full s=2k/8k: ascending 252.7/277.7, shift 253.2/201.4, '
               'spt 248.7/276.9, descending 250.3/274.7'},
    # Packed batches, windows and unequal lengths, measured with scripts/gpu_varlen_bench.py,
    # docs/benchmarks/varlen-2026-11-24-h100/ (H100, median of 3 interleaved rounds). Packed batches
    # run every order but shift here; arrival while each sequence is one group (64 KV tiles): beyond,
    # its groups tie or lose (the dense rows below).
    {'mask': 'window', 'schedule': 'spt',
     'source': 'measured H100 hdim128 8k causal window 2047: spt 467.8, descending 461.0, ascending 255.1; '
               'band 512/512: spt 389.3, descending 382.9, ascending 159.3'},
    {'mask': 'causal', 'varlen': True, 'head_dim_max': 64, 'schedule': 'spt',
     'source': 'measured H100 hdim64 causal, 7 documents of 256-4k tokens: spt 386.8, descending 342.9, '
               'ascending 342.8'},
    {'mask': 'causal', 'varlen': True, 'seqlen_max': 8192, 'schedule': 'arrival',
     'source': 'measured H100 hdim128 causal, 7 documents of 256-4k tokens: arrival 435.8, descending 408.1, '
               'spt 399.0 (GQA 4:1: arrival 395.3, spt 375.9; 29 documents of 64-1k: arrival 213.9, spt 208.4; '
               'hdim64: spt 381.7, arrival 370.0), docs/benchmarks/varlen-2026-11-24-h100/arrival/'},
    {'mask': 'causal', 'varlen': True, 'schedule': 'descending',
     'source': 'measured H100 hdim128 causal, 7 documents of 256-4k tokens, before arrival ran on packed '
               'batches: descending 415.2, spt 401.4, ascending 374.0 (longer sequences: arrival falls back '
               'to descending)'},
    {'mask': 'causal', 'equal_lengths': False, 'schedule': 'ascending',
     'source': 'measured H100 hdim128 causal 4 x (1k queries, 4k keys): ascending 473.7, descending 459.6, '
               'spt 454.8, arrival 314.7 (several KV tiles reach the first row together: no computed order)'},
    {'mask': 'full', 'varlen': True, 'schedule': 'ascending',
     'source': 'measured H100 hdim128 full, 7 documents of 256-4k tokens: spt 509.3, ascending 502.6 (a tie), '
               'descending 445.6'},
    # Head dims 33-48 (hdim 64's tiles with 48 padded columns): steps short against the ordered dQ
    # add, where arrival and shift keep the adds from queueing (docs/benchmarks/auto-head-dims-2026-11-26-h100/,
    # median of 3 interleaved rounds; at hdim 32 and 64 the rules below hold).
    {'mask': 'causal', 'head_dim_min': 33, 'head_dim_max': 48, 'seqlen_max': 8192, 'schedule': 'arrival',
     'source': 'measured H100 hdim40 causal s=1k/2k/4k/8k: arrival 197.0/254.6/299.8/329.0, ascending '
               '174.1/235.1/280.7/286.4, spt 169.2/218.2/242.1/248.6, shift 193.3/246.9/282.3/316.3; '
               'hdim48 s=1k/4k: arrival 257.7/378.9, shift 249.6/357.8, ascending 219.3/346.7'},
    {'mask': 'causal', 'head_dim_min': 33, 'head_dim_max': 48, 'schedule': 'shift',
     'source': 'measured H100 hdim40 causal s=16k: shift 337.9, descending 326.1, ascending 317.8, '
               'arrival 316.8 (groups), spt 263.8; hdim48: descending 420.9, shift 417.5, ascending 400.9'},
    {'mask': 'full', 'head_dim_min': 33, 'head_dim_max': 48, 'schedule': 'shift',
     'source': 'measured H100 hdim40 full s=1k/2k/4k/8k/16k: shift 268.7/289.1/323.6/340.6/339.1, next best '
               '203.2/245.4/272.2/291.2/311.5; hdim48 s=1k/4k/16k: shift 350.7/410.1/439.3, ascending '
               '240.2/376.2/426.6'},
    {'mask': 'causal', 'head_dim_max': 64, 'seqlen_max': 4096, 'schedule': 'arrival',
     'source': 'measured H100 hdim64 causal s=1k/2k/4k: arrival 303.8/387.6/450.2, ascending 293.6/369.4/410.2, '
               'spt 289.2/383.3/430.7; hdim32 s=1k/4k: arrival 225.1/315.7, spt 213.5/312.4, ascending '
               '212.4/310.4 (docs/benchmarks/auto-head-dims-2026-11-26-h100/; before arrival ran at these '
               'tiles: hdim64 s=1024 ascending 265.4, spt 256.8, descending 248.9)'},
    # Head dim 56 (hdim 64's tiles, 8 padded columns) beyond 4k: the causal symmetric shift, at every
    # head count measured (28-40, MHA and GQA 4:1); at hdim 64 spt leads at the same head counts, so
    # it is the padding, not the head count (docs/benchmarks/hdim56-heads-2026-11-26-h100/). Measured
    # at 8k and 16k, taken from past 4k (arrival's bound); an odd count of KV tiles (e.g. 8,256 tokens)
    # runs shift's fallback, descending (3-5 % behind shift at 8k, 2-5 % at 16k).
    {'mask': 'causal', 'head_dim_min': 49, 'head_dim_max': 56, 'schedule': 'shift',
     'source': 'measured H100 hdim56 causal s=8k/16k, median of 3 interleaved rounds, heads 28/32/36/40: '
               'shift 393.0/403.7, 403.8/426.5, 389.8/408.9, 388.7/401.8; spt 365.2/366.3, 383.8/370.9, '
               '368.0/361.1, 369.6/362.6; descending 371.8/387.4, 383.9/407.5, 370.6/391.9, 377.4/392.3; '
               'GQA 4:1 (36 heads): shift 382.3/412.2, spt 363.1/362.9; arrival (36/32 heads) 399.4/394.7, '
               '378.4/374.0 against shift 407.5/419.2, 396.4/405.2 (hdim64 at the same head counts: spt '
               '470.4-487.4/491.5-506.0, shift 458.0-465.8/468.1-489.0)'},
    # Beyond 4k spt: at hdim 64 ahead of the causal symmetric shift by 1.4-6.3 % in 6 of 8
    # measurements (behind by up to 2.5 % in the other 2), and at each head count from 28 to 40.
    {'mask': 'causal', 'head_dim_max': 64, 'schedule': 'spt',
     'source': 'measured H100 hdim64 causal s=2k/4k/8k/16k: spt 363.9/422.0/462.2/497.6, descending '
               '334.4/409.9/440.4/450.0, ascending 348.9/391.9/408.9/453.5 (2026-11-23); 2026-11-26 '
               '(docs/benchmarks/auto-head-dims-2026-11-26-h100/) s=8k/16k, 5 rounds: spt 495.5/513.4, '
               'shift 469.3/483.0 (GQA 4:1: 469.8/502.0 against 454.7/482.5); 3 rounds: spt 456.6/503.8, '
               'shift 468.2/496.9 (GQA 4:1: 450.5/488.8 against 452.4/480.6); hdim56 16k: shift 429.9, spt 366.9'},
    {'mask': 'causal', 'head_dim_max': 128, 'seqlen_max': 8192, 'schedule': 'arrival',
     'source': 'measured H100 hdim128 causal s=1k/2k/4k/8k with the dQ writer reading its next counter '
               'ahead, median of 3 interleaved rounds: arrival 301.5/401.0/470.2/516.8, descending '
               '278.9/387.5/460.9/494.3, spt 251.8/373.8/463.5/514.7, ascending 279.9/362.6/418.3/456.6 '
               '(GQA 4:1: arrival 241.0/358.1/457.8/510.9, next best 234.2/345.3/436.0/500.2) '
               '(docs/benchmarks/dq-readahead-2026-11-23-h100/); hdim96: inferred from hdim128'},
    {'mask': 'causal', 'head_dim_min': 129, 'head_dim_max': 192, 'seqlen_max': 6144, 'schedule': 'arrival',
     'source': 'measured H100 hdim192 s=2k: arrival 342.4, ascending 301.6, spt 243.8 '
               '(docs/benchmarks/wide-heads-2026-11-24-h100/); up to 64 KV tiles of 96 keys, one group'},
    {'mask': 'causal', 'schedule': 'descending',
     'source': 'measured H100 causal heads of more than 64 KV tiles, where arrival runs as groups launched '
               'top group first, median of 3 interleaved rounds (docs/benchmarks/arrival-groups-2026-11-24-h100/): '
               'hdim128 16k: descending 547.1, arrival 538.4 (groups of 32: 550.6, 16: 545.3), spt 543.8; '
               'hdim192 8k: descending 431.7, arrival 424.7, spt 370.4 (a tie or a loss for arrival: its rank '
               'wait is back to ~1,000 cycles a step once heads follow each other)'},
    {'mask': 'full', 'head_dim_max': 64, 'seqlen_max': 2048, 'schedule': 'shift',
     'source': 'measured H100 hdim64 full s=1k after the closed-form shift (whole-head groups): '
               'shift 371.8/369.7, ascending 347.9/345.8 (gpu_hopper_bwd.py / dash-bench, '
               'docs/benchmarks/hopper-shift-2026-11-23-h100/); s=1k/2k with the dQ writer no longer '
               'reading counters ahead at hdim 64, two paired runs and a median of 3 rounds: shift '
               '378.4/378.8 and 453.5/457.3/457.1, ascending 345.9/346.2 and 426.7/419.6/427.6 '
               '(docs/benchmarks/read-turn-2026-11-25-h100/; 2k before: 1.04x/0.99x)'},
    {'mask': 'full', 'head_dim_max': 64, 'seqlen_max': 8192, 'schedule': 'ascending',
     'source': 'measured H100 hdim64 full s=4k-16k: shift and ascending within the run-to-run '
               'scatter (4k: 509.0/508.4 vs 495.2/497.9 in paired runs, 476.3 vs 493.8 in a median '
               'of 3 rounds, docs/benchmarks/read-turn-2026-11-25-h100/)'},
    {'mask': 'full', 'head_dim_min': 129, 'head_dim_max': 192, 'seqlen_max': 2048, 'schedule': 'shift',
     'source': 'measured H100 hdim192 full s=2k: shift 394.0, ascending 381.1 (wide-heads-2026-11-24-h100/)'},
    # Up to hdim 128: at 192 shift runs split groups, which lose beyond 2k (the rule above).
    {'mask': 'full', 'head_dim_max': 128, 'seqlen_max': 4096, 'schedule': 'shift',
     'source': 'measured H100 hdim128 full s=1k: shift 398.6 and 396.9, ascending 361.0 and 360.0 (two runs, '
               'hopper-shift-2026-11-23-h100/); shift 402.9, ascending 380.8 (shift-writer-2026-11-24-h100/). '
               's=2k/4k/8k since the first dQ add stores (median of 3 interleaved rounds, '
               'auto-full-2026-11-25-h100/): shift 506.4/542.3/567.1, ascending 495.5/532.9/559.9, '
               'spt 494.7/533.0/566.1, descending 481.9/542.3/-; 2k in the run before: shift 499.0, '
               'ascending 478.2 (store-first-dq-2026-11-25-h100/); hdim96: inferred from hdim128'},
    {'mask': 'full', 'seqlen_max': 8192, 'schedule': 'ascending',
     'source': 'measured H100 full hdim128 s=8k: ascending, spt, descending and the closed-form shift '
               'within a few percent, the lead changing from run to run (2026-11-26: ascending 577.0 and '
               '529.0, shift 575.2 and 577.4, descending 528.9 and 548.7); hdim192 s=8k: ascending 478.4, '
               'spt 478.6, shift 326.6 (split groups)'},
    # Beyond 8k descending: ahead of ascending in all 11 measurements of 2026-11-26 at 16k, by
    # 0.3-8 %, though its rounds ran at lower SM clocks than ascending's; under sustained load at the
    # power cap (docs/benchmarks/sustained-orders-2026-11-26-h100/) the fastest order at hdim 128 and
    # 176 full 16k, and at 8k every order within 1 % at hdim 128, within 1.6 % at hdim 64.
    {'mask': 'full', 'schedule': 'descending',
     'source': 'measured H100 full s=16k (docs/benchmarks/auto-head-dims-2026-11-26-h100/): descending / '
               'ascending hdim128 596.2/550.8 and 587.0/584.6 (two runs), GQA 4:1 590.9/550.7; hdim64 '
               '531.8/509.1 and 529.3/527.2, GQA 4:1 529.3/513.3; hdim160 416.4/402.8, hdim96 513.6/504.0, '
               'hdim80 422.5/414.5, hdim72 376.6/370.8, hdim56 438.5/437.2; 2026-11-23 hdim128: '
               'descending 604.5, the best order (dq-readahead-2026-11-23-h100/)'},
]
