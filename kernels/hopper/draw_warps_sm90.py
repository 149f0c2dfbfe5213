"""The Hopper forward's dropout words drawn by the producer warpgroup's idle warps.

Why: with the mask drawn inline, the forward with dropout issued instructions on 40 % of its
cycles, as without (ncu, H100): its time is set by the consumer warps' chains of dependent
instructions, not by the SM's issue rate, and the Philox rounds in those chains made the forward
1.4-1.6x slower. FA4's producer warpgroup has four warps; warp 0 issues the TMA loads and the other
three idle. Here those three draw each KV step's Philox groups ahead of the consumers into a ring
of shared-memory stages, and a consumer thread reads its words with 16-byte loads: what is left
in the consumers is applying the mask.

A stage holds, for consumer thread t (of T), its two words of each of its column quads' groups
(quad q: the group of its row pair and columns 16q + 2(t % 4) + {0, 1, 8, 9}; word 0 of the two
for the even columns, word 1 for the odd, as dropout_sm90.quad_words gives them), word
k = 2q + parity at 32-bit offset (k // 4) * 4T + 4t + k % 4, so each load of four words is
16 contiguous bytes of a thread and 512 of a warp. A generator thread draws one group per
Philox call and stores its words where the two threads that hold the group read them.

The ring has the K/V pipeline's number of stages and advances once per KV step, in the order
FA4's loader walks the tiles and KV blocks, so a consumer step finds its stage and phase in the
K pipeline state it is handed. Per stage a 'full' barrier (every generator thread arrives after
its stores) and an 'empty' one (every consumer thread arrives after its loads). The consumers set
the ring up (the barriers and the seed, which only their arguments carry) and meet the
generators at a named barrier before the first step.

Imported only with the Hopper backend's packages present.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32
from cutlass.pipeline import PipelineUserType, make_pipeline_state
from flash_attn.cute.named_barrier import NamedBarrierFwd

GENERATOR_WARPS = 3            # warps 1-3 of the producer warpgroup
GENERATOR_THREADS = 32 * GENERATOR_WARPS
_FIRST_GENERATOR_THREAD = 32
_SETUP_BARRIER = max(NamedBarrierFwd) + 1   # the first id FA4's forward leaves free
_WORDS_PER_LOAD = 4
SHARED_MEMORY_BYTES = 227 * 1024   # what one CTA may take on sm90
# (kernel class, tile_m, tile_n) -> (whether the ring fitted, the struct's bytes with it), as
# kernels compiled with DRAW_WARPS found it (for scripts/gpu_dropout_forward_probe.py)
RING_FITS: dict = {}


def quads_per_thread(tile_n: int) -> int:
    """Column quads of a consumer thread in an m64 x tile_n accumulator (16 columns each)."""
    return tile_n // 16


def ring_fields(tile_n: int, consumer_threads: int, stages: int) -> dict:
    """The shared-storage fields of the ring, to be added to the kernel's struct."""
    words = _padded_words(tile_n)
    return dict(
        draw_barriers=cute.struct.MemRange[Int64, 2 * stages],     # full[0..stages), empty[...]
        draw_keys=cute.struct.MemRange[Uint32, 2],                 # the seed's two halves
        draw_words=cute.struct.Align[cute.struct.MemRange[Uint32, stages * consumer_threads * words], 128],
    )


def _padded_words(tile_n: int) -> int:
    words = 2 * quads_per_thread(tile_n)
    return -(-words // _WORDS_PER_LOAD) * _WORDS_PER_LOAD


class DrawRing:
    """The ring seen from one thread: its barriers, keys and words, from the kernel's shared
    storage (located through a field FA4 hands both sides: see `storage_of`)."""

    def __init__(self, storage, tile_m: int, tile_n: int, consumer_threads: int, stages: int, unroll: int = 2):
        self.tile_m, self.tile_n, self.unroll = tile_m, tile_n, unroll
        self.threads, self.stages = consumer_threads, stages
        self.quads = quads_per_thread(tile_n)
        words = _padded_words(tile_n)
        self.loads = words // _WORDS_PER_LOAD
        self.barriers = storage.draw_barriers.data_ptr()
        self.keys = storage.draw_keys.get_tensor(cute.make_layout(2))
        self.words = storage.draw_words.get_tensor(cute.make_layout(
            (_WORDS_PER_LOAD, consumer_threads, self.loads, stages),
            stride=(1, _WORDS_PER_LOAD, _WORDS_PER_LOAD * consumer_threads, words * consumer_threads)))

    def _full(self, index):
        return self.barriers + index

    def _empty(self, index):
        return self.barriers + self.stages + index

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def set_up(self, tidx, drop):
        """Consumer side, before the first step: one thread initialises the barriers and stores
        the seed; then every consumer meets the generators at the setup barrier."""
        full = [self._full(i) for i in range(self.stages)]
        empty = [self._empty(i) for i in range(self.stages)]
        keys, consumers = self.keys, self.threads
        if tidx == 0:
            for i in cutlass.range_constexpr(len(full)):
                cute.arch.mbarrier_init(full[i], GENERATOR_THREADS)
                cute.arch.mbarrier_init(empty[i], consumers)
            keys[0] = drop.key0
            keys[1] = drop.key1
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier(barrier_id=_SETUP_BARRIER, number_of_threads=self.threads + GENERATOR_THREADS)

    def read(self, tidx, state):
        """((0, quad), (word 0, word 1)) of consumer thread `tidx` (as dropout_sm90.MaskWords
        gives them) for the step whose K pipeline
        state is `state` (its stage and phase are the ring's): wait until the stage is full, load,
        and give the stage back."""
        cute.arch.mbarrier_wait(self._full(state.index), state.phase)
        got = cute.make_rmem_tensor((_WORDS_PER_LOAD, self.loads), Uint32)
        for j in range(self.loads):
            cute.autovec_copy(self.words[None, tidx, j, state.index], got[None, j])
        cute.arch.mbarrier_arrive(self._empty(state.index))
        return _GivenWords([((0, q), (got[(2 * q) % 4, (2 * q) // 4], got[(2 * q + 1) % 4, (2 * q + 1) // 4]))
                            for q in range(self.quads)])

    # ------------------------------------------------------------------ generators
    @cute.jit
    def generate(self, drop_words, block_info, SeqlenInfoCls, TileSchedulerCls):
        """Generator side (warps 1-3 of the producer warpgroup): every KV step of every tile, in
        the order FA4's loader walks them (the first block, n_block_max - 1, even when the
        tile sees no key block, then down to n_block_min). `drop_words(query, key, head, batch,
        key0, key1)` draws a group's four words."""
        cute.arch.barrier(barrier_id=_SETUP_BARRIER, number_of_threads=self.threads + GENERATOR_THREADS)
        key0, key1 = Uint32(self.keys[0]), Uint32(self.keys[1])
        gtid = cute.arch.thread_idx()[0] - _FIRST_GENERATOR_THREAD
        state = make_pipeline_state(PipelineUserType.Producer, self.stages)
        tile_scheduler = TileSchedulerCls()
        work_tile = tile_scheduler.initial_work_tile_info()
        while work_tile.is_valid_tile:
            m_block, head_idx, batch_idx, _ = work_tile.tile_idx
            seqlen = SeqlenInfoCls(batch_idx)
            n_block_min, n_block_max = block_info.get_n_block_min_max(seqlen, m_block)
            first_query = m_block * self.tile_m - getattr(seqlen, "q_shift", 0)   # tail-aligned tiles move up
            steps = cutlass.max(n_block_max - n_block_min, 1)
            for i in cutlass.range(steps, unroll=1):
                cute.arch.mbarrier_wait(self._empty(state.index), state.phase)
                self._draw_stage(drop_words, state.index, first_query, n_block_max - 1 - i, head_idx, batch_idx,
                                 gtid, key0, key1)
                cute.arch.mbarrier_arrive(self._full(state.index))
                state.advance()
            tile_scheduler.advance_to_next_work()
            work_tile = tile_scheduler.get_current_work()

    @cute.jit
    def _draw_stage(self, drop_words, index, first_query, n_block, head, batch, gtid, key0, key1):
        """One stage: every group of the tile (query tile m_block, KV block n_block), split over
        the generator threads (the loop unrolled `unroll` times: independent Philox chains for
        the scheduler to interleave). Group g: quad q = g % Q of lane pair p = (g // Q) % 16 of
        consumer warp w = g // 16Q. Warp w holds rows 16w + {0..15}; its lanes 8r + c and
        8r + c + 4 (p = 4r + c) rows 16w + 2r + {0, 1, 8, 9}, and quad q of both columns
        16q + 2c + {0, 1, 8, 9}: anchors 16w + 2r and 16q + 2c (bits 0 and 3 clear, as the mask's
        counters take them). Unsigned arithmetic: the divisions by powers of two are shifts."""
        quads, words = Uint32(self.quads), self.words
        first_query, first_key = Uint32(first_query), Uint32(n_block * self.tile_n)
        groups = (self.threads // 32) * 16 * self.quads
        for gi in cutlass.range(gtid, groups, GENERATOR_THREADS, unroll=self.unroll):
            g = Uint32(gi)
            quad = g % quads
            pair = (g // quads) % Uint32(16)
            warp = g // (quads * Uint32(16))
            row, col = pair // Uint32(4), pair % Uint32(4)
            w = drop_words(first_query + warp * Uint32(16) + Uint32(2) * row,
                           first_key + quad * Uint32(16) + Uint32(2) * col, head, batch, key0, key1)
            even = Int32(warp * Uint32(32) + Uint32(8) * row + col)   # lane + 4 holds the odd rows
            slot, load = Int32((Uint32(2) * quad) % Uint32(4)), Int32(quad // Uint32(2))
            words[slot, even, load, index] = w[0]
            words[slot + 1, even, load, index] = w[1]
            words[slot, even + 4, load, index] = w[2]
            words[slot + 1, even + 4, load, index] = w[3]


class _GivenWords:
    """A step's words read from the ring, in MaskWords' form (`all()`)."""

    def __init__(self, units):
        self._units = units

    def all(self):
        yield from self._units


def storage_of(struct, sQ: cute.Tensor):
    """The kernel's shared-storage struct at its place in shared memory, found from sQ (which
    FA4 hands both the loader and the consumers) and sQ's offset in the struct."""
    base = Int32(sQ.iterator.toint()) - Int32(struct._offsets["sQ"])
    return struct(cute.make_ptr(cutlass.Int8, base, cute.AddressSpace.smem, assumed_align=struct.__alignof__()))


def with_ring(struct, fields: dict):
    """A shared-storage struct with FA4's fields and the ring's after them."""
    annotations = dict(struct._annotations, **fields)
    return cute.struct(type("SharedStorageWithDraws", (), {"__annotations__": annotations}))

