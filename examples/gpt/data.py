"""Byte-level language modelling on the Python standard library's own source: no download.

The corpus is every `.py` file under the standard library's folder (the one that holds the `os`
module, `sysconfig.get_paths()["stdlib"]`), read in sorted order of their relative paths and
concatenated, optionally capped at `max_bytes`. Left out: `site-packages` and `dist-packages`
(installed packages, not the standard library) and `_sysconfigdata*.py` (generated when Python is
built: a dict of this installation's paths and compiler flags, not code). The corpus is a
function of the Python version (some Linux distributions ship the `test` package separately).

Tokens are bytes (vocabulary 256). The last `valid_fraction` of the byte stream is the `valid`
stream, the rest `train`; item `i` of a stream is the window of bytes [i*block_size,
i*block_size + block_size + 1): `tokens` its first block_size bytes, `targets` its last block_size.
Windows do not overlap, and neither do the two streams.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

EXCLUDED_DIRS = {"site-packages", "dist-packages"}  # at the top of the standard library's folder
GENERATED_PREFIX = "_sysconfigdata"  # _sysconfigdata__linux_x86_64-linux-gnu.py ...


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[Path]:
    """The `.py` files under `root`, sorted by relative path; installed packages and generated
    build data left out."""
    found = []
    for folder, dirs, files in os.walk(root):  # does not follow symbolic links into other folders
        rel = Path(folder).relative_to(root)
        dirs[:] = [
            d for d in dirs if d != "__pycache__" and not (rel == Path(".") and d in EXCLUDED_DIRS)
        ]
        found += [
            rel / f for f in files if f.endswith(".py") and not f.startswith(GENERATED_PREFIX)
        ]
    return [root / rel for rel in sorted(found, key=lambda p: p.as_posix())]


def read_corpus(root: Path | None = None, max_bytes: int | None = None) -> bytes:
    """The concatenated source files, at most `max_bytes` of them (None: all, about 30 MB)."""
    parts, size = [], 0
    for path in source_files(root or stdlib_dir()):
        if max_bytes is not None and size >= max_bytes:
            break
        data = path.read_bytes()
        parts.append(data)
        size += len(data)
    corpus = b"".join(parts)
    return corpus if max_bytes is None else corpus[:max_bytes]


class Windows(Dataset):
    """Non-overlapping windows of a byte stream: {"tokens": LongTensor[T], "targets":
    LongTensor[T]}."""

    def __init__(self, data: torch.Tensor, block_size: int):
        self.data, self.block_size = data, block_size

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return {"tokens": chunk[:-1], "targets": chunk[1:]}


class StdlibBytes:
    """train and valid streams of the standard library's source, tokenized at byte level."""

    vocab_size = 256

    def __init__(
        self, block_size: int = 256, max_bytes: int | None = 2_000_000, valid_fraction: float = 0.1
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not 0 < valid_fraction < 1:
            raise ValueError(f"valid_fraction must be between 0 and 1, got {valid_fraction}")
        corpus = read_corpus(max_bytes=max_bytes)
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        n_train = len(data) - int(len(data) * valid_fraction)
        self.block_size = block_size
        self.tokens_per_sample = (
            block_size  # every item has block_size tokens: tokens/s = samples/s * this
        )
        self.num_bytes = len(data)
        self._streams = {
            "train": Windows(data[:n_train], block_size),
            "valid": Windows(data[n_train:], block_size),
        }
        for name, stream in self._streams.items():
            if len(stream) == 0:
                raise ValueError(
                    f"the {name} stream has no window of {block_size + 1} bytes; "
                    f"raise max_bytes ({max_bytes}) or lower block_size"
                )

    def streams(self) -> dict[str, Windows]:
        return self._streams

    def tokens(self, stream: str = "train") -> int:
        """Tokens in one pass over `stream`: its windows times block_size."""
        return len(self._streams[stream]) * self.tokens_per_sample


def write_tokens(path: Path, tokens: bytes) -> None:
    """Byte tokens as a flat uint16 token file (the `train.bin` layout), written whole or not at
    all: processes that prepare the same file at once each write their own and rename it into
    place."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    np.frombuffer(tokens, dtype=np.uint8).astype(np.uint16).tofile(partial)
    os.replace(partial, path)


class StdlibTokenFiles:
    """The standard library's source as token files on disk, read through
    `phalanx.data.TokenWindows` (memory-mapped: the files may be far larger than memory).
    `folder/train.bin` and `folder/valid.bin` are prepared from the corpus where they are missing; a
    pretraining pipeline would write its own tokenizer's ids there instead."""

    vocab_size = 256

    def __init__(
        self,
        folder: str = "data/stdlib-tokens",
        block_size: int = 256,
        max_bytes: int | None = 2_000_000,
        valid_fraction: float = 0.1,
    ):
        from phalanx.data import TokenWindows

        folder = Path(folder)
        files = {"train": folder / "train.bin", "valid": folder / "valid.bin"}
        if not all(f.is_file() for f in files.values()):
            corpus = read_corpus(max_bytes=max_bytes)
            n_train = len(corpus) - int(len(corpus) * valid_fraction)
            write_tokens(files["train"], corpus[:n_train])
            write_tokens(files["valid"], corpus[n_train:])
        self.block_size = self.tokens_per_sample = block_size
        self._streams = {
            name: TokenWindows(path, block_size, "uint16") for name, path in files.items()
        }

    def streams(self) -> dict:
        return self._streams
