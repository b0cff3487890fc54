"""The TP block edges with communication overlapped by computation (``galaxy.core.edges`` picks them):
CoC (``coc``: chunked collectives beside the neighbour chunk's matmul), CCLoRA (``cclora``: the LoRA
branch under the base linear's collective) and async TP (``async_tp``: torch's symmetric-memory fused
ops). Each edge computes a block's entry transition + first linears and last linear + exit transition
where the fusion is exact, and the plain ``PlainEdge`` path elsewhere; ``common`` holds what they share."""
