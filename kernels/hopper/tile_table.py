"""Tile sizes of the Hopper backward: a fixed table (no autotuning), so two processes build the
same plan and the same bits. They are the tiles of the pinned flash-attn-4 sm90 kernel, which
`bwd_sm90.tiles` checks at run time (with dropout, one of FA4's other configs: DROPOUT_FULL_TILES)."""

# head dim -> (block_m, block_n) for (causal or windowed, full). hdim 128 full uses 80-row Q tiles.
_BWD_TILES = {
    64: ((128, 128), (128, 128)),
    96: ((64, 128), (64, 128)),
    128: ((64, 128), (80, 128)),
    192: ((64, 96), (64, 96)),
    256: ((64, 48), (64, 48)),
}


# With dropout, full masks at hdim 128 take the masked tiles: the dropout step's registers on
# 80-row tiles spill (80 bytes, in the per-step loop), on 64-row ones they do not.
# scripts/gpu_dropout_forward_probe.py --kernel bwd empties it to time the 80-row tiles.
DROPOUT_FULL_TILES = {128: (64, 128)}

HEAD_DIMS = tuple(sorted(_BWD_TILES))   # the table's head dims; the others run at the next one's tiles


# At hdim 128's tiles a row of 112 floats (head dims 104, 112) does not fit FA4's dQ conversion
# kernel: it copies such rows two threads a row, 128 rows a pass of its 256 threads, over Q tiles
# of 64 or 80 rows (GPU test: dQ off by 80 %). They run on the Triton backend.
_NOT_RUN = (104, 112)


def head_dim_refusal(head_dim: int) -> str | None:
    """Why the Hopper kernels do not run this head dim, or None where they do: a multiple of 8
    (16-byte rows of 16-bit values, TMA's alignment) up to 256, but for _NOT_RUN. One that is
    not in the table runs at the tiles and configuration of the next head dim up (FA4's sm90
    kernels pick theirs by the same ranges), its columns past the head dim zero in shared memory
    and never stored."""
    if 8 <= head_dim <= HEAD_DIMS[-1] and head_dim % 8 == 0 and head_dim not in _NOT_RUN:
        return None
    return (f"head_dim={head_dim}: the Hopper kernels run multiples of 8 from 8 to {HEAD_DIMS[-1]}, "
            f"but for {' and '.join(map(str, _NOT_RUN))}")


def table_head_dim(head_dim: int) -> int:
    """The table's head dim whose tiles `head_dim` runs at (the smallest one at least as large)."""
    refusal = head_dim_refusal(head_dim)
    if refusal:
        raise ValueError(refusal)
    return next(d for d in HEAD_DIMS if d >= head_dim)


def bwd_tiles(head_dim: int, masked: bool, dropout: bool = False) -> tuple[int, int]:
    """(block_m, block_n); `masked`: a causal or sliding-window mask (FA4 tiles both alike);
    `dropout`: the call drops (DROPOUT_FULL_TILES)."""
    row = table_head_dim(head_dim)
    masked_tiles, full_tiles = _BWD_TILES[row]
    if dropout and not masked:
        full_tiles = DROPOUT_FULL_TILES.get(row, full_tiles)
    return masked_tiles if masked else full_tiles
