"""Tile sizes of the Hopper backward: a fixed table (no autotuning), so two processes build the
same plan and the same bits. They are the tiles of the pinned flash-attn-4 sm90 kernel, which
`bwd_sm90.tiles` checks at run time."""

# head dim -> (block_m, block_n) for (causal, full). hdim 128 full uses 80-row Q tiles.
_BWD_TILES = {
    64: ((128, 128), (128, 128)),
    96: ((64, 128), (64, 128)),
    128: ((64, 128), (80, 128)),
}


HEAD_DIMS = tuple(sorted(_BWD_TILES))   # what the Hopper kernels run


def bwd_tiles(head_dim: int, causal: bool) -> tuple[int, int]:
    if head_dim not in _BWD_TILES:
        raise ValueError(f"head_dim={head_dim}: the Hopper backward has tiles for {sorted(_BWD_TILES)}")
    causal_tiles, full_tiles = _BWD_TILES[head_dim]
    return causal_tiles if causal else full_tiles
