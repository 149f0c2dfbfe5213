"""Triton attention backward: preprocess, KV-stationary main kernel, postprocess; and `split`.

- preprocess: ``delta = rowsum(dO * O)`` (fp32), the softmax-gradient correction term.
- main, KV-stationary: one program owns one KV tile of one KV head (for the causal shift, two
  tiles one after the other) and loops over the query heads of its GQA group, so dK/dV of the
  group are summed in registers in a fixed order. For each visited Q tile it recomputes P and
  dS, updates dK/dV, and adds its dQ partial into an fp32 accumulator:
    * ``atomic``: plain atomic adds (order = arrival order: the non-deterministic reference point);
    * ordered schedules (``ascending``, ``spt``, ``descending``, ``shift``): the visit order and
      each add's rank come from the launch plan's tables (dash_plugin/schedules/plan.py), handed
      in by the Triton backend (triton_backend.py); per-dQ-tile int32 semaphores: wait until the
      counter equals my rank (acquire), add, barrier, release-increment (docs/DESIGN.md,
      "Determinism rules", rules 4-6).
- postprocess: dQ accumulator (fp32) rounded once to the input dtype.
- ``split``: the same KV kernel without dQ, plus Q-stationary dQ programs that recompute P and
  dS and own their dQ tile outright: no cross-program reduction at all.

Launch order and waiting. An ordered wait is only safe if the program it waits on is running
or done. The launch plan orders each sequence's workers so that every dQ tile's contributors
are launched in rank order (a topological order of the "rank r before rank r+1" edges). Then
acyclic schedules (ascending, descending, spt) wait only on earlier-launched programs, which
holds both on the GPU (blocks are dispatched in launch order, x fastest) and in the Triton
interpreter (programs run one by one, grid axis 0 outermost). The cyclic shift waits inside
groups of at most the plan's group size (a shape-only number); the plan launches it on a
persistent grid (PERSISTENT) of programs that are all resident at once, having checked that a
group fits. The interpreter cannot run cyclic waits, so there the plan skips them (NO_WAIT) and
only correctness is tested. Nothing here chooses an order: the kernels execute the plan.
"""
import triton
import triton.language as tl

from ._triton_common import (col_range, dropout_keep, interior_cols, interior_rows, load_tile, q_tile_program,
                             row_range, seq_bounds, tanh, visible)

# Kernel modes of the KV-stationary kernel: how its programs hand in their dQ partials (the
# schedule registry's kernel modes, docs/DESIGN.md). constexpr, so the kernels can name them.
ATOMIC = tl.constexpr(0)    # atomic adds in arrival order (not deterministic)
ORDERED = tl.constexpr(1)   # adds in rank order behind one semaphore per dQ tile (the schedule tables)
SPLIT = tl.constexpr(2)     # no dQ: `_bwd_dq_kernel` recomputes it


# ---------------------------------------------------------------- preprocess

@triton.jit
def _bwd_preprocess(O, DO, DELTA, CU_Q, seq_base, seqlen_q_dense, head_dim,
                    stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                    stride_lb, stride_lh, stride_ls,
                    VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2) + seq_base   # launches cover at most MAX_GRID_SEQS sequences
    q_start, seqlen_q = seq_bounds(CU_Q, b, seqlen_q_dense, VARLEN)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    rmask = rows < seqlen_q
    msk = rmask[:, None] & (dims[None, :] < head_dim)
    r64 = (q_start + rows).to(tl.int64)[:, None]
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + r64 * stride_os + dims[None, :],
                mask=msk, other=0.0).to(tl.float32)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + r64 * stride_ds + dims[None, :],
                 mask=msk, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(DELTA + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + (q_start + rows).to(tl.int64)
             * stride_ls, delta, mask=rmask)


# ---------------------------------------------------------------- shared recompute
#
# Values that travel together are passed as tuples (Triton inlines every call and unpacks them at
# compile time, so grouping changes no generated instruction):
#   shape = (seqlen_q, seqlen_k, head_dim, window_left, window_right)  this sequence's lengths, the mask
#   score = (scale, scale_log2, softcap, seed, drop_threshold, inv_keep)  softmax scale, softcap, dropout
# The kernels' own parameters stay one per value: they are the compiled signature.

@triton.jit
def _recompute(qk, dp, lse, delta, r, c, m0, n0, h, b, shape, score,
               MASKED: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
               SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, TRANSPOSED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """P (dropped and rescaled, for dV) and dS (w.r.t. the scaled, uncapped score) of one tile,
    from the products qk = Q K^T and dp = dO V^T. The KV kernel works on transposed tiles (S^T:
    rows along axis 1, TRANSPOSED) and the dQ kernel on plain ones: ``r``, ``c``, ``lse``,
    ``delta`` come shaped to broadcast either way ([1, M]/[N, 1] or [M, 1]/[1, N]); the tile is
    rows [m0, m0 + BLOCK_M) x columns [n0, n0 + BLOCK_N)."""
    seqlen_q, seqlen_k, _, window_left, window_right = shape
    _, scale_log2, softcap, seed, drop_threshold, inv_keep = score
    if SOFTCAP:
        t = tanh(qk * (scale_log2 / 1.4426950408889634 / softcap))
        s = softcap * t * 1.4426950408889634
    else:
        s = qk * scale_log2
    # lse = +inf on empty rows makes P = 0 there.
    p = tl.exp2(s - lse * 1.4426950408889634)
    if MASKED:
        ok = visible(r, c, seqlen_q, seqlen_k, window_left, window_right, HAS_WL, HAS_WR)
        p = tl.where(ok, p, 0.0)
    if DROPOUT:
        keep = dropout_keep(seed, m0, n0, h, b, drop_threshold, BLOCK_M, BLOCK_N, TRANSPOSED)
        pd = tl.where(keep, p * inv_keep, 0.0)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    else:
        pd = p
    ds = p * (dp - delta)
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return pd, ds


# ---------------------------------------------------------------- ordered dQ adds

@triton.jit
def _wait_for_rank(sem_ptr, rank, ERR, max_polls, m0, n0, h, b, DEBUG_WAITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Spin until the dQ tile's counter equals my rank (acquire: everything the previous rank
    added is visible once we see our rank). With DEBUG_WAITS the spin gives up after max_polls
    (or as soon as another program gave up) and the first program to give up records where."""
    cur = tl.atomic_add(sem_ptr, 0, sem="acquire")
    if DEBUG_WAITS:
        polls = 0
        while (cur != rank) & (polls < max_polls):
            cur = tl.atomic_add(sem_ptr, 0, sem="acquire")
            polls += 1
            if polls % 1024 == 0:
                if tl.atomic_add(ERR, 0) != 0:   # someone is stuck already: stop waiting
                    polls = max_polls
        if cur != rank:
            if tl.atomic_cas(ERR, 0, 1) == 0:
                tl.store(ERR + 1, m0 // BLOCK_M)
                tl.store(ERR + 2, rank)
                tl.store(ERR + 3, cur)
                tl.store(ERR + 4, n0 // BLOCK_N)
                tl.store(ERR + 5, h)
                tl.store(ERR + 6, b)
    else:
        while cur != rank:
            cur = tl.atomic_add(sem_ptr, 0, sem="acquire")


@triton.jit
def _add_in_rank_order(dq_ptrs, dq, msk, sem_ptr, rank, sync, m0, n0, h, b,
                       NO_WAIT: tl.constexpr, DEBUG_WAITS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """The semaphore protocol of docs/DESIGN.md (rule 4): wait until the dQ tile's counter equals
    my rank (acquire), add, make every thread's add complete (barrier) and visible (release), then
    increment. sync = (ERR, max_polls) of the debug waits."""
    ERR, max_polls = sync
    if not NO_WAIT:
        _wait_for_rank(sem_ptr, rank, ERR, max_polls, m0, n0, h, b, DEBUG_WAITS, BLOCK_M, BLOCK_N)
    # One writer at a time; atomics go straight to L2, so no stale L1 line is read.
    tl.atomic_add(dq_ptrs, dq, mask=msk, sem="relaxed")
    # All threads' adds are issued before the release below.
    tl.debug_barrier()
    tl.atomic_add(sem_ptr, 1, sem="release")


# ---------------------------------------------------------------- main: KV-stationary

@triton.jit
def _kv_step(dk, dv, m0, kv, head, shape, score, sem_ptr, rank, sync,
             MODE: tl.constexpr, NO_WAIT: tl.constexpr, DEBUG_WAITS: tl.constexpr, MASKED: tl.constexpr,
             EVEN_D: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
             DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (Q tile from row m0, KV tile) stage of the KV-stationary backward, on the transposed
    tile S^T (BLOCK_N x BLOCK_M): P^T and dS^T come out of the products in the orientation the
    dK/dV products consume, so only the dQ product needs a transpose. MASKED=False: the tile is
    whole and fully visible (`interior_rows`), no masks.
    kv = (k, v, n0): the KV tile in registers and its first column;
    head = (h, b, q_base, do_base, dq_base, lse_base, delta_base, stride_qs, stride_dos, stride_dqs,
    stride_ls): the query head's rows of this sequence."""
    k, v, n0 = kv
    h, b, q_base, do_base, dq_base, lse_base, delta_base, stride_qs, stride_dos, stride_dqs, stride_ls = head
    seqlen_q, seqlen_k, head_dim, _, _ = shape
    scale = score[0]
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    r64 = rows.to(tl.int64)
    q = load_tile(q_base, rows, stride_qs, seqlen_q, head_dim, MASKED, EVEN_D, BLOCK_D)
    do = load_tile(do_base, rows, stride_dos, seqlen_q, head_dim, MASKED, EVEN_D, BLOCK_D)
    if MASKED:
        rmask = rows < seqlen_q
        lse = tl.load(lse_base + r64 * stride_ls, mask=rmask, other=float("inf"))
        delta = tl.load(delta_base + r64 * stride_ls, mask=rmask, other=0.0)
    else:
        lse = tl.load(lse_base + r64 * stride_ls)
        delta = tl.load(delta_base + r64 * stride_ls)
    qk_t = tl.dot(k, tl.trans(q))
    dp_t = tl.dot(v, tl.trans(do))
    pd_t, ds_t = _recompute(qk_t, dp_t, lse[None, :], delta[None, :], rows[None, :], cols[:, None], m0, n0, h, b,
                            shape, score, MASKED, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, True, BLOCK_M, BLOCK_N)
    dv += tl.dot(pd_t.to(do.dtype), do)
    ds_lo = ds_t.to(q.dtype)
    dk += tl.dot(ds_lo, q)
    if MODE != SPLIT:
        dq = tl.dot(tl.trans(ds_lo), k) * scale
        dq_ptrs = dq_base + r64[:, None] * stride_dqs + dims[None, :]
        msk = (rows < seqlen_q)[:, None] & (dims < head_dim)[None, :]
        if MODE == ATOMIC:
            tl.atomic_add(dq_ptrs, dq, mask=msk, sem="relaxed")
        else:
            _add_in_rank_order(dq_ptrs, dq, msk, sem_ptr, rank, sync, m0, n0, h, b, NO_WAIT, DEBUG_WAITS,
                               BLOCK_M, BLOCK_N)
    return dk, dv


@triton.jit
def _kv_walk(dk, dv, first, last, a, z, steps, sem_base, kv, head, shape, score, sync,
             FROM_TABLE: tl.constexpr, MASKED: tl.constexpr,
             MODE: tl.constexpr, NO_WAIT: tl.constexpr, DEBUG_WAITS: tl.constexpr,
             EVEN_D: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
             DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Visit Q tiles with the KV tile `kv`, one `_kv_step` each.
    FROM_TABLE (ordered mode): the worker's table steps [first, last), in the schedule's order;
    steps = (T_QTILE, T_RANK) offset to the worker's row gives each step's Q tile and rank, and
    the Q tiles inside [a, z) are interior (no masks). Otherwise: the Q tiles of rows
    [first, last) in ascending order, all MASKED or all interior; no ranks."""
    if FROM_TABLE:
        T_QTILE, T_RANK = steps
        for step in range(first, last):
            m_tile = tl.load(T_QTILE + step)
            rank = tl.load(T_RANK + step)
            m0 = m_tile * BLOCK_M
            if (m0 >= a) & (m0 < z):
                dk, dv = _kv_step(dk, dv, m0, kv, head, shape, score, sem_base + m_tile, rank, sync, MODE,
                                  NO_WAIT, DEBUG_WAITS, False, EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT,
                                  BLOCK_M, BLOCK_N, BLOCK_D)
            else:
                dk, dv = _kv_step(dk, dv, m0, kv, head, shape, score, sem_base + m_tile, rank, sync, MODE,
                                  NO_WAIT, DEBUG_WAITS, True, EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT,
                                  BLOCK_M, BLOCK_N, BLOCK_D)
    else:
        for m0 in range(first, last, BLOCK_M):
            dk, dv = _kv_step(dk, dv, m0, kv, head, shape, score, sem_base, 0, sync, MODE, NO_WAIT,
                              DEBUG_WAITS, MASKED, EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT,
                              BLOCK_M, BLOCK_N, BLOCK_D)
    return dk, dv


@triton.jit
def _kv_program(pid, hk, b, tensors, strides, tables, seqs, shape_dense, score, sync, group, heads_q, num_m_max,
                MODE: tl.constexpr, NO_WAIT: tl.constexpr, DEBUG_WAITS: tl.constexpr, VARLEN: tl.constexpr,
                EVEN_D: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
                DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One KV-stationary program: worker slot ``pid`` of KV head ``hk`` in sequence ``b``. The
    tuples are those `_bwd_kv_kernel` builds; shape_dense has the dense lengths, which varlen
    sequences replace with their own."""
    Q, K, V, DO, DK, DV, DQA, LSE, DELTA, SEM = tensors
    (stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
     stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
     stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ls) = strides
    T_PERM, T_NWORK, T_SEGKV, T_SEGEND, T_QTILE, T_RANK, t_stride_b, t_max_workers, t_max_steps = tables
    CU_Q, CU_K = seqs
    seqlen_q_dense, seqlen_k_dense, head_dim, window_left, window_right = shape_dense
    q_start, seqlen_q = seq_bounds(CU_Q, b, seqlen_q_dense, VARLEN)
    k_start, seqlen_k = seq_bounds(CU_K, b, seqlen_k_dense, VARLEN)
    shape = (seqlen_q, seqlen_k, head_dim, window_left, window_right)
    b64 = b.to(tl.int64)
    tb = b64 * t_stride_b   # table row of this sequence (dense: stride 0, one shared row)
    if MODE == ORDERED:
        if pid >= tl.load(T_NWORK + tb):
            return
        worker = tl.load(T_PERM + tb * t_max_workers + pid)
        wrow = tb * t_max_workers + worker   # this worker's row in the per-worker tables
        num_segments = 2
    else:
        if pid * BLOCK_N >= seqlen_k:
            return
        worker = pid
        wrow = tb * 0
        num_segments = 1

    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    for seg in range(num_segments):
        if MODE == ORDERED:
            n_tile = tl.load(T_SEGKV + wrow * 2 + seg)
            seg_end = tl.load(T_SEGEND + wrow * 2 + seg)
            # Loaded, not carried over from the previous segment: Triton 3.6 compiled a carried
            # `seg_begin = seg_end` as 0 in the plain build, so the second segment replayed the
            # first one's Q tiles and ranks and waited forever (docs/benchmarks/NOTES.md).
            seg_begin = tl.load(T_SEGEND + wrow * 2 + seg - 1, mask=seg > 0, other=0)
        else:
            n_tile = worker
            seg_begin = 0
            seg_end = 0
        if n_tile >= 0:
            n0 = n_tile * BLOCK_N
            cols = n0 + tl.arange(0, BLOCK_N)
            cmask = cols < seqlen_k
            kmsk = cmask[:, None] & dmask[None, :]
            c64 = (k_start + cols).to(tl.int64)[:, None]
            k = tl.load(K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + c64 * stride_ks + dims[None, :],
                        mask=kmsk, other=0.0)
            v = tl.load(V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + c64 * stride_vs + dims[None, :],
                        mask=kmsk, other=0.0)
            kv = (k, v, n0)
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            lo, hi_row = row_range(n0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_N, HAS_WL, HAS_WR)
            m_lo = tl.maximum(lo, 0) // BLOCK_M * BLOCK_M
            a, z = interior_rows(n0, m_lo, hi_row, seqlen_q, seqlen_k, window_left, window_right,
                                 BLOCK_M, BLOCK_N, HAS_WL, HAS_WR)
            for hi in range(group):
                h = hk * group + hi
                h64 = h.to(tl.int64)
                row0 = q_start.to(tl.int64)
                head = (h, b,
                        Q + b64 * stride_qb + h64 * stride_qh + row0 * stride_qs,
                        DO + b64 * stride_dob + h64 * stride_doh + row0 * stride_dos,
                        DQA + b64 * stride_dqb + h64 * stride_dqh + row0 * stride_dqs,
                        LSE + b64 * stride_lb + h64 * stride_lh + row0 * stride_ls,
                        DELTA + b64 * stride_lb + h64 * stride_lh + row0 * stride_ls,
                        stride_qs, stride_dos, stride_dqs, stride_ls)
                sem_base = SEM + (b64 * heads_q + h64) * num_m_max
                if MODE == ORDERED:   # the schedule's visits, from the tables
                    tq = wrow * t_max_steps
                    dk, dv = _kv_walk(dk, dv, seg_begin, seg_end, a, z, (T_QTILE + tq, T_RANK + tq), sem_base,
                                      kv, head, shape, score, sync, True, False, MODE, NO_WAIT, DEBUG_WAITS,
                                      EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)
                else:
                    # Masked top edge (causal diagonal), interior, masked bottom edge (window,
                    # ragged end): ascending Q tiles as one walk over [m_lo, hi_row).
                    dk, dv = _kv_walk(dk, dv, m_lo, a, a, z, (T_QTILE, T_RANK), sem_base, kv, head, shape,
                                      score, sync, False, True, MODE, NO_WAIT, DEBUG_WAITS,
                                      EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)
                    dk, dv = _kv_walk(dk, dv, a, z, a, z, (T_QTILE, T_RANK), sem_base, kv, head, shape,
                                      score, sync, False, False, MODE, NO_WAIT, DEBUG_WAITS,
                                      EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)
                    dk, dv = _kv_walk(dk, dv, z, hi_row, a, z, (T_QTILE, T_RANK), sem_base, kv, head, shape,
                                      score, sync, False, True, MODE, NO_WAIT, DEBUG_WAITS,
                                      EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)
            tl.store(DK + b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + c64 * stride_dks + dims[None, :],
                     (dk * score[0]).to(DK.dtype.element_ty), mask=kmsk)
            tl.store(DV + b64 * stride_dvb + hk.to(tl.int64) * stride_dvh + c64 * stride_dvs + dims[None, :],
                     dv.to(DV.dtype.element_ty), mask=kmsk)


@triton.jit
def _bwd_kv_kernel(
    Q, K, V, DO, DK, DV, DQA, LSE, DELTA, CU_Q, CU_K, SEM, ERR,
    T_PERM, T_NWORK, T_SEGKV, T_SEGEND, T_QTILE, T_RANK,
    seq_base, seed, drop_threshold, scale, scale_log2, softcap, inv_keep,
    window_left, window_right, max_polls,
    seqlen_q_dense, seqlen_k_dense, group, head_dim, heads_q, num_m_max,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_ls,
    t_stride_b, t_max_workers, t_max_steps, num_items, PERSISTENT: tl.constexpr,
    MODE: tl.constexpr, NO_WAIT: tl.constexpr, DEBUG_WAITS: tl.constexpr, VARLEN: tl.constexpr,
    EVEN_D: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, SOFTCAP: tl.constexpr,
    DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The KV-stationary backward (one launch of a launch plan): MODE is one of ATOMIC, ORDERED,
    SPLIT; the T_* tables (ordered mode) give each worker's KV tiles, Q-tile visits and ranks."""
    tl.static_assert(MODE == ATOMIC or MODE == ORDERED or MODE == SPLIT)
    tl.static_assert(MODE == ORDERED or not (PERSISTENT or NO_WAIT or DEBUG_WAITS))   # waits: ordered mode only
    tl.static_assert((BLOCK_M >= 16) & (BLOCK_N >= 16) & (BLOCK_D >= 16))        # tl.dot's smallest tiles
    tensors = (Q, K, V, DO, DK, DV, DQA, LSE, DELTA, SEM)
    strides = (stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               stride_dob, stride_dos, stride_doh, stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs,
               stride_dvh, stride_dqb, stride_dqs, stride_dqh, stride_lb, stride_lh, stride_ls)
    tables = (T_PERM, T_NWORK, T_SEGKV, T_SEGEND, T_QTILE, T_RANK, t_stride_b, t_max_workers, t_max_steps)
    seqs = (CU_Q, CU_K)
    shape_dense = (seqlen_q_dense, seqlen_k_dense, head_dim, window_left, window_right)
    score = (scale, scale_log2, softcap, seed, drop_threshold, inv_keep)
    sync = (ERR, max_polls)
    if PERSISTENT:
        # Cyclic waits (shift): at most as many programs as the GPU holds at once, each taking
        # work items (slot fastest, then KV head, then sequence) in increasing order, so a
        # group's members all run at the same time once every earlier item is done
        # (docs/DESIGN.md, rule 5 and "The launch plan"). Block dispatch order is then irrelevant.
        heads_kv = heads_q // group
        for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
            _kv_program(item % t_max_workers, (item // t_max_workers) % heads_kv,
                        item // (t_max_workers * heads_kv) + seq_base, tensors, strides, tables, seqs, shape_dense,
                        score, sync, group, heads_q, num_m_max, MODE, NO_WAIT, DEBUG_WAITS, VARLEN, EVEN_D,
                        HAS_WL, HAS_WR, SOFTCAP, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)
    else:
        # launches cover at most MAX_GRID_SEQS sequences: axis 2 counts from seq_base
        _kv_program(tl.program_id(0), tl.program_id(1), tl.program_id(2) + seq_base, tensors, strides, tables,
                    seqs, shape_dense, score, sync, group, heads_q, num_m_max, MODE, NO_WAIT, DEBUG_WAITS, VARLEN,
                    EVEN_D, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)


# ---------------------------------------------------------------- split: Q-stationary dQ

@triton.jit
def _dq_tiles(acc, q_rows, n_from, n_to, kv_bases, h, b, shape, score,
              MASKED: tl.constexpr, EVEN_D: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
              SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """dQ of one Q tile over the KV tiles [n_from, n_to); MASKED=False as in the forward.
    q_rows = (q, do, lse, delta, m0, rows): the Q tile's operands, first row and rows;
    kv_bases = (k_base, v_base, stride_ks, stride_vs): its KV head in this sequence."""
    q, do, lse, delta, m0, rows = q_rows
    k_base, v_base, stride_ks, stride_vs = kv_bases
    seqlen_k, head_dim = shape[1], shape[2]
    for n0 in range(n_from, n_to, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k = load_tile(k_base, cols, stride_ks, seqlen_k, head_dim, MASKED, EVEN_D, BLOCK_D)
        v = load_tile(v_base, cols, stride_vs, seqlen_k, head_dim, MASKED, EVEN_D, BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))
        _, ds = _recompute(qk, dp, lse[:, None], delta[:, None], rows[:, None], cols[None, :], m0, n0, h, b,
                           shape, score, MASKED, HAS_WL, HAS_WR, SOFTCAP, DROPOUT, False, BLOCK_M, BLOCK_N)
        acc += tl.dot(ds.to(q.dtype), k)
    return acc


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU_Q, CU_K,
    seq_base, seed, drop_threshold, scale, scale_log2, softcap, inv_keep,
    window_left, window_right,
    seqlen_q_dense, seqlen_k_dense, group, head_dim,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh, stride_ls,
    VARLEN: tl.constexpr, EVEN_D: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """`split`'s dQ: one program owns one Q tile of one query head and sums its dQ over the KV
    tiles it sees, on chip, in ascending order: no cross-program reduction."""
    tl.static_assert((BLOCK_M >= 16) & (BLOCK_N >= 16) & (BLOCK_D >= 16))   # tl.dot's smallest tiles
    pid_m, h, b, q_start, seqlen_q, k_start, seqlen_k = q_tile_program(CU_Q, CU_K, seq_base, seqlen_q_dense,
                                                                       seqlen_k_dense, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    shape = (seqlen_q, seqlen_k, head_dim, window_left, window_right)
    score = (scale, scale_log2, softcap, seed, drop_threshold, inv_keep)
    hk = h // group
    b64 = b.to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    rmask = rows < seqlen_q
    msk = rmask[:, None] & dmask[None, :]
    r64 = (q_start + rows).to(tl.int64)[:, None]
    q = tl.load(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + r64 * stride_qs + dims[None, :],
                mask=msk, other=0.0)
    do = tl.load(DO + b64 * stride_dob + h.to(tl.int64) * stride_doh + r64 * stride_dos + dims[None, :],
                 mask=msk, other=0.0)
    stat = b64 * stride_lb + h.to(tl.int64) * stride_lh + (q_start + rows).to(tl.int64) * stride_ls
    lse = tl.load(LSE + stat, mask=rmask, other=float("inf"))
    delta = tl.load(DELTA + stat, mask=rmask, other=0.0)
    q_rows = (q, do, lse, delta, m0, rows)
    kv_bases = (K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + k_start.to(tl.int64) * stride_ks,
                V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + k_start.to(tl.int64) * stride_vs,
                stride_ks, stride_vs)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = col_range(m0, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, HAS_WL, HAS_WR)
    n_lo = tl.maximum(lo, 0) // BLOCK_N * BLOCK_N
    a, z = interior_cols(m0, n_lo, hi, seqlen_q, seqlen_k, window_left, window_right,
                         BLOCK_M, BLOCK_N, HAS_WL, HAS_WR)
    # Masked edge, interior, masked edge: the plain ascending walk over [n_lo, hi).
    acc = _dq_tiles(acc, q_rows, n_lo, a, kv_bases, h, b, shape, score, True, EVEN_D, HAS_WL, HAS_WR, SOFTCAP,
                    DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)
    acc = _dq_tiles(acc, q_rows, a, z, kv_bases, h, b, shape, score, False, EVEN_D, HAS_WL, HAS_WR, SOFTCAP,
                    DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)
    acc = _dq_tiles(acc, q_rows, z, hi, kv_bases, h, b, shape, score, True, EVEN_D, HAS_WL, HAS_WR, SOFTCAP,
                    DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D)
    tl.store(DQ + b64 * stride_dqb + h.to(tl.int64) * stride_dqh + r64 * stride_dqs + dims[None, :],
             (acc * scale).to(DQ.dtype.element_ty), mask=msk)
