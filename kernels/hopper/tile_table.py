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

HEAD_DIMS = tuple(sorted(_BWD_TILES))   # what the Hopper kernels run


def bwd_tiles(head_dim: int, masked: bool, dropout: bool = False) -> tuple[int, int]:
    """(block_m, block_n); `masked`: a causal or sliding-window mask (FA4 tiles both alike);
    `dropout`: the call drops (DROPOUT_FULL_TILES)."""
    if head_dim not in _BWD_TILES:
        raise ValueError(f"head_dim={head_dim}: the Hopper backward has tiles for {sorted(_BWD_TILES)}")
    masked_tiles, full_tiles = _BWD_TILES[head_dim]
    if dropout and not masked:
        full_tiles = DROPOUT_FULL_TILES.get(head_dim, full_tiles)
    return masked_tiles if masked else full_tiles
