"""Launch settings of the Triton kernels (``galaxy.kernels._triton_utils``): a row block is the smallest power
of two holding the row, refused past the fused-row limit, with more warps as it grows; ``as_rows`` views
``[..., cols]`` as rows with a unit last stride, copying only when it must."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # also when this file is run on its own

import pytest  # noqa: E402
import torch  # noqa: E402

from galaxy.kernels._triton_utils import MAX_ROW_BLOCK, as_rows, persistent_programs, row_block  # noqa: E402


def test_row_block_is_the_smallest_power_of_two_holding_the_row():
    warps = []
    for n in [1, 2, 3, 100, 2047, 2048, 2049, 8191, 8192, 65536]:
        block, w = row_block(n)
        assert block >= n and block & (block - 1) == 0 and (block == 1 or block // 2 < n), n
        warps.append(w)
    assert warps == sorted(warps) and set(warps) == {4, 8, 16}  # more warps for longer rows, at most 16
    with pytest.raises(ValueError, match=f"exceeds the fused-row limit {MAX_ROW_BLOCK}"):
        row_block(MAX_ROW_BLOCK + 1)


def test_as_rows_copies_only_a_strided_last_dim():
    t = torch.arange(24.0).view(2, 3, 4)
    rows = as_rows(t)
    assert rows.shape == (6, 4) and rows.data_ptr() == t.data_ptr()
    strided = t.transpose(1, 2)  # [2, 4, 3], last stride 4
    rows = as_rows(strided)
    assert rows.stride(-1) == 1 and rows.data_ptr() != t.data_ptr() and torch.equal(rows, strided.reshape(8, 3))
    assert persistent_programs(torch.device("cpu"), 2) == 2 and 1 <= persistent_programs(torch.device("cpu"), 100)
