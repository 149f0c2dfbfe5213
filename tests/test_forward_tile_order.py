"""The persistent Hopper forward's work table (kernels/hopper/fwd_tile_order.py), on the CPU:
every tile dealt exactly once, the KV steps of a tile as the mask gives them, the CTAs' loads
within a tile of the mean, the rule that picks the grid, and where Q tiles are aligned to the
end of the sequence."""
from dataclasses import replace

import pytest

from dash_plugin.kernels.hopper.fwd_tile_order import (
    PERSISTENT_MAX_MEAN_STEPS, TILE_OVERHEAD, ForwardTiles, deal, makespan, persistent_pays, tail_shift, total_steps,
    work_table)

SHAPES = [
    ForwardTiles(8, 16, 2048, 2048, 128, 128, 128, causal=True),
    ForwardTiles(16, 32, 1024, 1024, 64, 192, 128, causal=True),
    ForwardTiles(1, 16, 16384, 16384, 128, 128, 128, causal=True),
    ForwardTiles(4, 16, 4096, 4096, 128, 128, 128, causal=False),
    ForwardTiles(3, 2, 1000, 1000, 128, 128, 128, causal=True, rows_per_query=4),      # GQA heads packed
    ForwardTiles(2, 8, 700, 1300, 64, 192, 128, causal=True),                          # bottom-right
    ForwardTiles(2, 8, 1300, 700, 128, 128, 128, causal=True),                         # rows that see nothing
    ForwardTiles(2, 4, 1000, 1000, 128, 128, 128, causal=False, window_left=256, window_right=0),
    ForwardTiles(2, 4, 1000, 1000, 64, 192, 128, causal=False, window_left=128, window_right=128),
    ForwardTiles(1, 1, 300, 300, 128, 128, 128, causal=True),                         # fewer tiles than CTAs
    ForwardTiles(16, 32, 1024, 1024, 64, 192, 128, causal=True, q_shift=128),          # tail-aligned
    ForwardTiles(2, 8, 700, 1300, 64, 192, 128, causal=True, q_shift=68),
    ForwardTiles(2, 8, 1000, 1000, 64, 192, 128, causal=True, q_shift=152),
    ForwardTiles(2, 8, 700, 1300, 64, 192, 128, causal=False, window_left=256, window_right=0, q_shift=68),
]


def brute_kv_steps(t: ForwardTiles, block: int) -> int:
    """KV tiles between the first and last key any row of the Q tile sees, from the mask itself.
    Rows above the sequence (tail-aligned tiles) count with the mask's formula, as the kernel
    bounds its KV tiles from them too: with a left window they can reach a KV tile no query sees."""
    shift = t.seqlen_k - t.seqlen_q
    seen = []
    for r in range(block * t.tile_m - t.q_shift, min((block + 1) * t.tile_m - t.q_shift,
                                                     t.seqlen_q * t.rows_per_query)):
        i = r // t.rows_per_query
        right = 0 if t.causal else t.window_right
        for j in range(t.seqlen_k):
            if right is not None and j > i + shift + right:
                continue
            if t.window_left is not None and j < i + shift - t.window_left:
                continue
            seen.append(j)
    return 0 if not seen else max(seen) // t.tile_n - min(seen) // t.tile_n + 1


@pytest.mark.parametrize("tiles", SHAPES, ids=str)
def test_every_tile_is_dealt_exactly_once(tiles):
    lists = deal(tiles, 132)
    assert 0 < len(lists) <= 132 and all(lists)
    assert sorted(t for tile_ids in lists for t in tile_ids) == list(range(tiles.num_block * tiles.batch * tiles.heads))


@pytest.mark.parametrize("tiles", SHAPES[4:], ids=str)
def test_kv_steps_are_the_masks(tiles):
    assert [tiles.kv_steps(b) for b in range(tiles.num_block)] == [max(brute_kv_steps(tiles, b), 1)
                                                                    for b in range(tiles.num_block)]


def test_rows_that_see_no_key_make_a_tile_of_one_step():
    """FA4's forward runs a tile's first KV step even when its rows see no key."""
    tiles = ForwardTiles(1, 1, 1300, 700, 128, 128, 128, causal=True)
    assert tiles.kv_steps(0) == 1 and brute_kv_steps(tiles, 0) == 0 and tiles.kv_steps(tiles.num_block - 1) == 6


@pytest.mark.parametrize("tiles", SHAPES[:4] + [SHAPES[10]], ids=str)
def test_no_cta_gets_much_more_than_its_share(tiles):
    """Within 4 % of the mean at the protocol's shapes (a round-robin deal of the same order is
    16 % over at hdim 128 causal 16k)."""
    lists = deal(tiles, 132)
    total = sum(tiles.kv_steps(t % tiles.num_block) + TILE_OVERHEAD for tile_ids in lists for t in tile_ids)
    assert makespan(tiles, lists) <= 1.04 * total / len(lists)


def test_longest_tiles_go_out_first_and_a_heads_tiles_stay_together():
    causal = ForwardTiles(2, 2, 1024, 1024, 128, 128, 128, causal=True)
    firsts = [tile_ids[0] for tile_ids in deal(causal, 132)]
    assert [t % causal.num_block for t in firsts[:4]] == [7, 7, 7, 7]   # the last Q tile of each head first
    full = ForwardTiles(2, 2, 1024, 1024, 128, 128, 128, causal=False)
    firsts = [tile_ids[0] for tile_ids in deal(full, 132)]
    assert firsts == list(range(32))   # every tile alike: head by head, block by block


def test_work_table_layout():
    tiles = SHAPES[0]
    lists = deal(tiles, 132)
    table = work_table(tiles, 132)
    starts, ids = table[:133], table[133:]
    assert starts[0] == 0 and all(starts[c + 1] - starts[c] == len(lists[c]) for c in range(132))
    assert list(ids[:-1]) == [t for tile_ids in lists for t in tile_ids] and ids[-1] == 0
    assert work_table(ForwardTiles(1, 1, 300, 300, 128, 128, 128, causal=True), 132) == (0, 1, 2, 3, 2, 1, 0, 0)   # 3 CTAs for 3 tiles, longest first; padding


def test_l2_section_is_a_power_of_two_of_heads_that_fit():
    assert ForwardTiles(1, 16, 16384, 16384, 128, 128, 128, causal=True).l2_section == 2   # 8 MiB a head
    assert ForwardTiles(16, 32, 1024, 1024, 64, 192, 128, causal=True).l2_section == 64
    assert ForwardTiles(1, 1, 1 << 20, 1 << 20, 128, 128, 128, causal=True).l2_section == 1


def test_the_persistent_grid_is_taken_where_it_pays():
    def shape(seqlen, causal, head_dim=128):
        tm = 128 if head_dim == 128 else 192
        return ForwardTiles(16384 // seqlen, 2048 // head_dim, seqlen, seqlen, head_dim, tm, 128, causal=causal)

    assert all(persistent_pays(shape(s, True, d)) for s in (1024, 4096, 16384) for d in (64, 128))   # causal
    assert all(persistent_pays(shape(s, False, 64)) for s in (1024, 4096, 16384))                  # full, hdim 64
    assert persistent_pays(shape(2048, False)) and not persistent_pays(shape(4096, False))         # full, hdim 128
    at_the_bar = shape(128 * PERSISTENT_MAX_MEAN_STEPS, False)
    assert persistent_pays(at_the_bar) and not persistent_pays(shape(128 * PERSISTENT_MAX_MEAN_STEPS + 128, False))
    windowed = ForwardTiles(1, 16, 16384, 16384, 128, 128, 128, causal=False, window_left=4096, window_right=4096)
    assert not persistent_pays(windowed)   # a wide band: long tiles of equal length, as full masks


def test_tail_aligned_tiles_end_on_the_last_query_where_that_cuts_steps():
    """At 1k tokens in 192-row tiles the short tile moves from the bottom (8 KV steps) to the
    top (1 step): 27 steps a head instead of 32. No shift where it saves nothing (full masks,
    lengths that are a multiple of the tile, 1000 tokens in 128-row tiles), nor with GQA heads
    packed into the rows, nor where dropout's 16-row groups would split."""
    causal_1k = ForwardTiles(16, 32, 1024, 1024, 64, 192, 128, causal=True)
    assert tail_shift(causal_1k) == 128 and tail_shift(causal_1k, multiple=16) == 128
    shifted = replace(causal_1k, q_shift=128)
    assert shifted.num_block == causal_1k.num_block == 6
    assert [shifted.kv_steps(b) for b in range(6)] == [1, 2, 4, 5, 7, 8]
    assert (total_steps(causal_1k), total_steps(shifted)) == (32, 27)
    assert tail_shift(ForwardTiles(8, 32, 2048, 2048, 64, 192, 128, causal=True)) == 64      # 101 -> 96 steps
    assert tail_shift(replace(causal_1k, causal=False)) == 0
    assert tail_shift(ForwardTiles(8, 16, 2048, 2048, 128, 128, 128, causal=True)) == 0
    assert tail_shift(ForwardTiles(2, 8, 1000, 1000, 128, 128, 128, causal=True)) == 0      # 36 steps either way
    assert tail_shift(ForwardTiles(2, 2, 1024, 1024, 64, 192, 128, causal=True, rows_per_query=4)) == 0
    thousand = ForwardTiles(2, 8, 1000, 1000, 64, 192, 128, causal=True)
    assert tail_shift(thousand) == 152 and tail_shift(thousand, multiple=16) == 0
    # more queries than keys: a tile whose rows see no key still runs one step, so moving the
    # tiles saves nothing here and they stay (212 x 107 would count 2 -> 1 if empty tiles ran none)
    assert tail_shift(ForwardTiles(1, 1, 212, 107, 64, 192, 128, causal=True)) == 0
