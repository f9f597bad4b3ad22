"""Block ids per KV-cache group, and the groups that take part in transfers.

vLLM's hybrid memory allocator (HMA) gives block ids per KV-cache group; kvd
moves the *transfer* groups' (``KVCacheConfig.transfer_groups``), numbered
0..G-1 as NixlConnector numbers them, sliding-window groups clipped to the
window (``nixl/base_scheduler.py:140-151,250-291``). Block ids always travel
as :data:`kvd.requests.BlockGroups` (one group is ``[[...]]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import index
from typing import TYPE_CHECKING, Any

from kvd.requests import BlockGroups

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


def as_groups(block_ids: Any, max_ids: int | None = None, max_groups: int | None = None) -> BlockGroups:
    """``remote_block_ids`` -> block ids per KV-cache group.

    Accepts vLLM 0.32's per-group form ``[[...], [...]]`` (``BlockIds``, a
    tuple of lists that JSON turns into a list of lists) and the older flat
    ``[...]`` (one group). Raises ValueError or TypeError for anything
    else (not a list or tuple, an id that is no integer): P's ids come in
    the decode engine's API request (kvd.shim.vllm.params). An id must be
    an integer already (``operator.index``: an ``int``, a bool, a numpy
    integer), as JSON gives P's ids; ``int()`` would also have taken
    ``"4_0"``, ``"٤٠"`` and ``40.9`` (and cost more: 0.35 against 0.24 us
    for 4 ids here, ``python -m timeit``).

    ``max_ids`` (ids per group) and ``max_groups``: bounds checked before
    any id is converted, so that an API client's 200,000 ids for a short
    prompt cost a ``len``, not ~0.1 s of the engine step (measured on this
    machine). Past either, ValueError.
    """
    if not check_counts(block_ids, max_ids, max_groups):
        return []
    # map(index, ...), not a nested comprehension: half the time, on the
    # decode scheduler's per-load path (docs/PERFORMANCE.md section 2).
    if isinstance(block_ids[0], (list, tuple)):
        return [list(map(index, g)) for g in block_ids]
    return [list(map(index, block_ids))]


def check_counts(block_ids: Any, max_ids: int | None = None, max_groups: int | None = None) -> bool:
    """The part of :func:`as_groups` that reads no id: False for no ids at
    all, True for a list (or tuple) of groups, or of ids, within
    ``max_ids`` a group and ``max_groups`` groups; else ValueError. A
    ``len`` per group: the decode scheduler checks this on the engine's step
    so that what it hands the workers is bounded, and leaves converting the
    ids to the client's sender thread (``LoadSpec.resolve``)."""
    if not block_ids:
        return False
    if not isinstance(block_ids, (list, tuple)):
        raise ValueError(f"block ids must be a list, not {type(block_ids).__name__}")
    if isinstance(block_ids[0], (list, tuple)):
        if max_groups is not None and len(block_ids) > max_groups:
            raise ValueError(f"block ids for {len(block_ids)} KV-cache groups, more than {max_groups}")
        if max_ids is not None:
            for g in block_ids:
                if len(g) > max_ids:
                    raise ValueError(f"{len(g)} block ids in a group, more than {max_ids}")
    elif max_ids is not None and len(block_ids) > max_ids:
        raise ValueError(f"{len(block_ids)} block ids, more than {max_ids}")
    return True


def first_group(block_ids: Any) -> list[int]:
    """Block ids of KV cache group 0 from ``remote_block_ids`` (see :func:`as_groups`)."""
    groups = as_groups(block_ids)
    return groups[0] if groups else []


def own_groups(block_ids: Any) -> BlockGroups:
    """:func:`as_groups` for block ids this shim's scheduler built (lists of
    ints per group): those are returned as they are, neither copied nor
    converted (the worker's per-load cost on the engine step,
    docs/PERFORMANCE.md): nobody changes them once the scheduler made the
    load (``LoadRequest`` is kept as given by the client too). Anything else
    goes through :func:`as_groups`."""
    if block_ids and type(block_ids[0]) is list:
        return block_ids
    return as_groups(block_ids)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(-a // b)


@dataclass
class TransferGroups:
    """The KV-cache groups that take part in transfers, and how to clip them.

    vLLM's block ids come per KV-cache group; kvd numbers the *transfer*
    groups (``KVCacheConfig.transfer_groups``) 0..G-1, as NixlConnector does.

    Attributes:
        group_ids: indices of the transfer groups among all groups.
        num_groups: all KV-cache groups (what vLLM's block id tuples hold).
        window_blocks: per transfer group, the blocks a sliding window keeps
            (``cdiv(window, block_size) + 1``, NixlConnector's
            ``blocks_per_sw``), 0 for groups that keep every block.
        layer_group: layer name -> transfer group index.
        block_sizes: tokens per block of each transfer group.
    """

    group_ids: tuple[int, ...] = (0,)
    num_groups: int = 1
    window_blocks: tuple[int, ...] = (0,)
    layer_group: dict[str, int] = field(default_factory=dict)
    block_sizes: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, kv_cache_config: KVCacheConfig | None) -> TransferGroups:
        """The transfer groups of vLLM's ``KVCacheConfig`` (its ``transfer_group_ids``
        when set, else every group), with block sizes (tokens), sliding windows
        in blocks (``cdiv(window, block_size) + 1``) and the layer -> group map.
        None or no groups: the single-group default."""
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
            return cls()
        all_groups = list(kv_cache_config.kv_cache_groups)
        ids = tuple(getattr(kv_cache_config, "transfer_group_ids", range(len(all_groups))))
        windows, layers, sizes = [], {}, []
        for i, gid in enumerate(ids):
            spec = all_groups[gid].kv_cache_spec
            sizes.append(int(spec.block_size))
            if isinstance(spec, SlidingWindowSpec) and spec.sliding_window:
                windows.append(cdiv(int(spec.sliding_window), int(spec.block_size)) + 1)
            else:
                windows.append(0)
            for name in all_groups[gid].layer_names:
                layers[name] = i
        return cls(group_ids=ids, num_groups=len(all_groups), window_blocks=tuple(windows),
                   layer_group=layers, block_sizes=tuple(sizes))

    @property
    def count(self) -> int:
        """Number of transfer groups."""
        return len(self.group_ids)

    def select(self, block_ids: Any) -> BlockGroups:
        """vLLM's per-group block ids (all groups) -> the transfer groups' lists.

        Raises:
            ValueError: a group count that is neither all groups nor the
                transfer groups.
        """
        groups = [list(g) for g in block_ids]
        if len(groups) == self.num_groups:
            return [groups[i] for i in self.group_ids]
        if len(groups) == self.count:
            return groups
        raise ValueError(f"block ids for {len(groups)} KV-cache groups; this engine has {self.num_groups} "
                         f"({self.count} transferable)")

    def to_transfer(self, fresh: list[list[int]]) -> BlockGroups:
        """:meth:`select` then :meth:`clip` for block id lists the caller
        made and gives up (vLLM's ``KVCacheBlocks.get_unhashed_block_ids_all_groups``
        builds new lists per call): with every group transferred and no
        sliding window they are returned as they are, without the two copies
        (the decode scheduler's per-load cost, docs/PERFORMANCE.md section 2).

        Raises:
            ValueError: as :meth:`select`.
        """
        if len(fresh) == self.num_groups == len(self.group_ids) and not any(self.window_blocks):
            return fresh
        return self.clip(self.select(fresh))

    def clip(self, groups: BlockGroups) -> BlockGroups:
        """Sliding-window groups keep the blocks of the window only (the tail),
        as NixlConnector's ``get_exchange_clipped_blocks``. Other groups as is."""
        return [g[-n:] if n and len(g) > n else list(g) for g, n in zip(groups, self.window_blocks)]
