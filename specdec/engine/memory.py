"""Splitting the engine's one KV memory budget between the target's and the drafters' runners.

Every runner gets the same number of pages (a drafter needs KV for the same tokens as the
target), so a page of the whole engine costs the sum of each runner's bytes per page. Example:
target 30 layers x 2 x 16 slots x 3 heads x 64 x 4 B = 737,280 B/page, a 10-layer early-exit
drafter 245,760 B/page; 1 GiB / 983,040 B = 1092 pages each (17,472 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVShare:
    name: str  # "target", or the drafter runner's name
    bytes_per_page: int
    num_pages: int

    @property
    def bytes(self) -> int:
        return self.bytes_per_page * self.num_pages


@dataclass(frozen=True)
class KVSplit:
    num_pages: int  # pages per runner
    page_size: int
    shares: tuple[KVShare, ...]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def describe(self) -> str:
        parts = [f"{s.name} {s.bytes / 2**20:.1f} MiB ({s.bytes_per_page} B/page)"
                 for s in self.shares]
        total = sum(s.bytes for s in self.shares) / 2**20
        return (f"KV cache: {self.num_pages} pages x {self.page_size} slots = {self.num_tokens} "
                f"tokens per model; {', '.join(parts)}; {total:.1f} MiB in all")


def split_kv(bytes_per_page: dict[str, int], page_size: int, max_model_len: int,
             memory_bytes: int | None = None, num_pages: int | None = None) -> KVSplit:
    """Pages per runner from ``num_pages`` (given) or ``memory_bytes`` (split across runners).

    ValueError, naming every runner's size, when one request of ``max_model_len`` tokens does
    not fit.
    """
    per_page = sum(bytes_per_page.values())
    if num_pages is None:
        assert memory_bytes is not None, "need memory_bytes or num_pages"
        num_pages = memory_bytes // per_page
    split = KVSplit(num_pages, page_size, tuple(
        KVShare(name, b, num_pages) for name, b in bytes_per_page.items()))
    if num_pages * page_size < max_model_len:
        sizes = ", ".join(f"{name} {b // page_size} B/token" for name, b in bytes_per_page.items())
        need = -(-max_model_len // page_size)
        have = f"{memory_bytes} bytes" if memory_bytes is not None else f"num_pages={num_pages}"
        raise ValueError(
            f"KV cache too small: {have} give {num_pages} pages of {page_size} slots per model, "
            f"but one request of max_model_len={max_model_len} tokens needs {need} pages "
            f"({need * per_page} bytes for {sizes}); raise kv_cache_memory / num_pages or lower "
            "max_model_len")
    return split
