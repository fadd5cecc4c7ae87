"""The GGML types the qmatmul kernel reads, as it reads them: each one's code in ``qformats.h``, the file's block and
the kernel's, and the row widths it takes (``block_formats.py`` repacks the rows)."""
from __future__ import annotations

from dataclasses import dataclass

from quickdraft.models import grid_formats
from quickdraft.models.qmatmul import BLOCK


@dataclass(frozen=True)
class BlockFormat:
    """One GGML type as the kernel reads it: ``code`` (qformats.h), the file's block (``block`` weights in
    ``block_bytes``), the kernel's block of 256 columns (``kernel_bytes``) and tail record (``tail_cols`` columns in
    ``tail_bytes``; 0: K must be a multiple of 256)."""

    name: str
    code: int
    block: int
    block_bytes: int
    kernel_bytes: int
    tail_cols: int
    tail_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block

    def takes(self, in_features: int) -> bool:
        """True when a row of ``in_features`` columns fits this format (the file's blocks and the kernel's)."""
        rest = in_features % BLOCK
        return in_features % self.block == 0 and (rest == 0 or (self.tail_cols and rest % self.tail_cols == 0))

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row in the kernel's layout."""
        if not self.takes(in_features):
            raise ValueError(f"{self.name} rows cannot have {in_features} columns")
        rest = in_features % BLOCK
        return in_features // BLOCK * self.kernel_bytes + (rest // self.tail_cols * self.tail_bytes if rest else 0)

    def file_row_bytes(self, in_features: int) -> int:
        return in_features // self.block * self.block_bytes


FORMATS = {f.name: f for f in (
    BlockFormat("Q4_0", 20, 32, 18, 144, 32, 18),
    BlockFormat("Q4_1", 21, 32, 20, 160, 32, 20),
    BlockFormat("Q5_0", 22, 32, 22, 176, 32, 22),
    BlockFormat("Q5_1", 23, 32, 24, 192, 32, 24),
    BlockFormat("Q8_0", 24, 32, 34, 272, 32, 34),
    BlockFormat("Q4_K", 25, 256, 144, 148, 0, 0),
    BlockFormat("Q5_K", 26, 256, 176, 180, 0, 0),
    BlockFormat("Q6_K", 27, 256, 210, 210, 0, 0),
    BlockFormat("IQ4_NL", 28, 32, 18, 144, 32, 18),
    BlockFormat("IQ4_XS", 29, 256, 136, 138, 0, 0),
    BlockFormat("Q1_0", 30, 128, 18, 36, 128, 18),
    BlockFormat("Q2_0", 31, 64, 18, 72, 64, 18),
    BlockFormat("MXFP4", 32, 32, 17, 136, 32, 17),
    BlockFormat("Q2_K", 33, 256, 84, 84, 0, 0),
    BlockFormat("Q3_K", 34, 256, 110, 110, 0, 0),
    BlockFormat("TQ2_0", 42, 256, 66, 66, 0, 0),
    BlockFormat("TQ1_0", 43, 256, 54, 54, 0, 0),
    *(BlockFormat(name, code, 256, size, size, 0, 0)  # codes 35 .. in qformats.h's order
      for code, (name, size) in enumerate(grid_formats.BLOCK_BYTES.items(), start=35)),
)}
