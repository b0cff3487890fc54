"""The TP block edges with communication overlapped by computation: CoC (``coc``: chunked collectives
beside the neighbour chunk's matmul), CCLoRA (``cclora``: the LoRA branch under the base linear's
collective) and async TP (``async_tp``: torch's symmetric-memory fused ops). Each replaces a block's
``Boundaries.enter`` + first linears and last linear + ``Boundaries.leave`` where the fusion is exact;
``common`` holds what they share."""
