"""How tensors become chunks of a checkpoint (``galaxy.train.checkpoint.shards``): an async save stages a
sharded piece, a view into its flat shard, as it was when the save started, and only that piece."""

from __future__ import annotations

import torch


def test_async_staging_copies_a_piece_as_it_was(tmp_path):
    """A sharded piece is a view into its flat shard: the async save stages that view alone, with the
    values it had when the save started (the write itself held back until the shard has changed)."""
    import io
    import threading

    from galaxy.train.checkpoint import shards

    flat = torch.arange(20, dtype=torch.float64)
    gate, write = threading.Event(), shards._RankWriter.write_data

    def held_back(self, plan, planner):
        assert gate.wait(30)
        return write(self, plan, planner)

    shards._RankWriter.write_data = held_back  # test-only: the write waits for the change below
    try:
        done = shards.write_chunks(str(tmp_path), 0, [shards.Chunk("x", (4, 3), (1, 0), flat[5:11].view(2, 3))],
                                   async_save=True)
        flat.add_(100)
        gate.set()
        chunk = done.result()["chunks"]["x"][0]
    finally:
        shards._RankWriter.write_data = write
    with open(tmp_path / chunk["file"], "rb") as f:
        f.seek(chunk["offset"])
        saved = torch.load(io.BytesIO(f.read(chunk["length"])), weights_only=True)
    assert torch.equal(saved, torch.arange(5, 11, dtype=torch.float64).view(2, 3))
    assert saved.untyped_storage().nbytes() == 6 * 8, "only the piece is written, not its whole shard"
