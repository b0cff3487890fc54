"""The NF4 storage format: its block sizes, the two code books (QLoRA's NF4 values, bitsandbytes'
signed 8-bit dynamic type for the absmax) and the row-by-row container. Shared by the torch reference
(``galaxy.loralib.nf4``) and the Triton kernel (``galaxy.kernels.triton_nf4``, which takes the fields)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 64  # weights per absmax
SCALE_BLOCK = 256  # absmax values per second-level scale

# QLoRA, appendix E (the NF4 data type; bitsandbytes ``get_4bit_type("nf4")``).
NF4_VALUES = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)

def _dynamic_values() -> tuple[float, ...]:
    """bitsandbytes' signed 8-bit dynamic type (``create_dynamic_map(signed=True)``): 256 sorted
    values, a dynamic exponent (powers of ten) and a shrinking fraction; the absmax code book."""
    data: list[float] = []
    for i in range(7):  # exponent bits: 7, total bits: 8, signed
        boundaries = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist() + ((-(10 ** (-6 + i))) * means).tolist()  # fp32 products
    data += [0.0, 1.0]
    data.sort()
    return tuple(data)


# The absmax code book's values (fp32 numbers), made once: a constant that torch.compile reads as it is.
DYNAMIC_VALUES = _dynamic_values()


def code_book(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A code book as an fp32 tensor on ``device``. Inside a torch.compile graph, a constant of the
    graph (the cached ``nf4_code`` / ``dynamic_code`` are for eager calls)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def nf4_code(device: torch.device) -> torch.Tensor:
    return code_book(NF4_VALUES, device)


@functools.lru_cache(maxsize=None)
def dynamic_code(device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """The absmax code book (``DYNAMIC_VALUES``) on ``device``."""
    return code_book(DYNAMIC_VALUES, device)


@dataclass
class NF4Rows:
    """A matrix ``[rows, cols]`` in NF4, row by row. Every tensor's dim 0 is the row."""

    packed: torch.Tensor  # uint8 [rows, blocks * 32]: two codes a byte, high nibble first
    absmax_code: torch.Tensor  # uint8 [rows, blocks]: absmax - offset in the dynamic 8-bit type
    absmax_scale: torch.Tensor  # fp32 [rows, ceil(blocks / 256)]
    absmax_offset: torch.Tensor  # fp32 [rows]: the mean of the row's absmax
    cols: int

    @property
    def rows(self) -> int:
        return self.packed.shape[0]
