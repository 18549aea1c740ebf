"""Prefix caching for a hybrid model: shared K/V pages plus Gated DeltaNet state snapshots (host bookkeeping).

A request can skip the prefill of a prefix only if both halves of the model's state at the end of that prefix
exist: the attention layers' K/V of every earlier position, and the GDN layers' recurrent and conv state at exactly
that position (it cannot be rebuilt from K/V). So the cache holds:

- **pages**: full K/V pages, content-addressed by a chain of 128-bit blake2b digests (parent digest, the page's
  token ids). A lookup walks the chain from the root and also checks each node's parent and token ids, so a hit is
  exact whatever the digests do. Full pages are never written again; pages are reference-counted by the requests
  using them and the snapshots pinning them, and freed (their node dropped) at zero.
- **snapshots**: a GDN state entry in the device's snapshot pool (`Snapshot.entry`) saved at an exact position P,
  with refs on the full pages of its prefix and its own copy of the page holding positions P - P % page_size .. P
  (a request resuming at P copies it into a fresh page of its own, which it goes on writing). Snapshots are
  evicted least recently used when the pool or the free pages run out.

Where snapshots are taken (docs/architecture.md says why): at the end of every finished request (the next turn of a
conversation resumes there), at every prefill chunk end before the prompt's end, and at the branch point of a
prompt whose prefix matches cached pages beyond its best snapshot (the scheduler ends a chunk there), so the next
prompt with that prefix resumes at a page boundary. The device copies are the engine's (executor.save / restore);
this module only decides and keeps count. One instance per data-parallel replica.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np


def page_digest(parent: bytes, page: bytes) -> bytes:
    """128-bit digest of a full page (its token ids as int32 bytes) given its parent's digest (a chance collision
    is ~n^2 / 2^129 for n pages, and lookups compare token ids besides)."""
    return hashlib.blake2b(parent + page, digest_size=16).digest()


@dataclasses.dataclass(eq=False, slots=True)
class Node:
    """A cached full page: the chain of pages from the root to it holds tokens [0, depth * page_size)."""
    digest: bytes
    parent: Node | None
    tokens: tuple
    page: int
    depth: int
    snapshots: dict = dataclasses.field(default_factory=dict)    # partial-page token ids -> Snapshot


@dataclasses.dataclass(eq=False)
class Snapshot:
    entry: int                  # index in the device snapshot pool (0 is null)
    node: Node                  # the node of its last full page (the root below one page)
    partial: tuple              # token ids after node's pages: positions depth * page_size .. length
    length: int                 # P: the position the state was saved at
    pages: list[int]            # the full pages of its prefix (a ref each)
    page: int                   # its copy of the partial page (0 when P is page-aligned)
    restoring: int = 0          # admitted requests yet to be restored from it (never evicted meanwhile)


@dataclasses.dataclass
class Hit:
    """A prompt's best cached prefix: `snapshot` (or None) and the pages of the longest cached page chain."""
    snapshot: Snapshot | None
    chain: list[int]            # pages of the prompt's leading full pages found in the cache

    @property
    def length(self) -> int:
        return self.snapshot.length if self.snapshot else 0


@dataclasses.dataclass
class Copy:
    """One device copy: GDN state between a slot and a snapshot entry, and K/V page src -> dst (0, 0: none)."""
    slot: int
    entry: int
    src_page: int
    dst_page: int
    tokens: list | None = None  # restores: the prefix's token ids (the sampler's prompt mask is rebuilt from them)


class PrefixCache:
    """One replica's page allocator and prefix cache. `free_pages` is the replica's free list (page 0 is null)."""

    def __init__(self, page_size: int, free_pages: list[int], num_snapshots: int, enabled: bool = True):
        self.ps = page_size
        self.free_pages = free_pages
        self.enabled = enabled and num_snapshots > 0
        self.free_entries = list(range(num_snapshots, 0, -1))
        self.root = Node(b"", None, (), 0, 0)
        self.nodes: dict[bytes, Node] = {}
        self.by_page: dict[int, Node] = {}
        # per page, as arrays so that a long prompt's thousands of pages are counted in one vectorised step
        size = max(free_pages, default=0) + 1
        self.refs = np.zeros(size, np.int32)           # refs (requests and snapshots)
        self.snap_refs = np.zeros(size, np.int32)      # refs held by snapshots
        self.reclaimable = np.zeros(size, np.bool_)    # only snapshots hold it (evicting them frees it)
        self.num_reclaimable = 0
        self.snapshots: dict[Snapshot, None] = {}  # LRU order: oldest first

    # -- pages ---------------------------------------------------------------------------------------------------
    def _ref(self, pages, snap: bool = False):
        """One more ref on each of `pages` (distinct page ids)."""
        pages = np.asarray(pages, np.intp)
        self.refs[pages] += 1
        if snap:
            self.snap_refs[pages] += 1
        self._update(pages)

    def _unref(self, pages, snap: bool = False):
        """One ref fewer on each of `pages` (distinct); those left with none are freed, their nodes dropped."""
        pages = np.asarray(pages, np.intp)
        self.refs[pages] -= 1
        if snap:
            self.snap_refs[pages] -= 1
        self._update(pages)
        freed = pages[self.refs[pages] == 0].tolist()
        for p in freed:
            node = self.by_page.pop(p, None)
            if node is not None:
                del self.nodes[node.digest]
        self.free_pages.extend(freed)

    def _update(self, pages: np.ndarray):
        held = self.refs[pages]
        now = (held == self.snap_refs[pages]) & (held > 0)
        self.num_reclaimable += int(np.count_nonzero(now)) - int(np.count_nonzero(self.reclaimable[pages]))
        self.reclaimable[pages] = now

    def available(self) -> int:
        """Pages an allocation can get: free ones plus those only evictable snapshots hold."""
        return len(self.free_pages) + self.num_reclaimable

    def allocate(self, n: int) -> list[int] | None:
        """n fresh pages (one ref each), evicting snapshots as needed; None if they cannot be had (when the free
        and snapshot-only pages fall short, nothing is evicted; pages pinned by a snapshot awaiting its restore
        can still make it fail after some evictions)."""
        if n > self.available():
            return None
        while len(self.free_pages) < n and self._evict_one():
            pass
        if len(self.free_pages) < n:
            return None
        cut = len(self.free_pages) - n
        pages = self.free_pages[cut:][::-1]                  # the order popping them one by one gave
        del self.free_pages[cut:]
        self.refs[pages] = 1                # free pages: no refs before, none from a snapshot, not reclaimable
        return pages

    def share(self, pages: list[int]):
        """A request takes a ref on cached pages."""
        self._ref(pages)

    def release(self, pages: list[int]):
        self._unref(pages)

    # -- lookup --------------------------------------------------------------------------------------------------
    def digests(self, tokens: list[int], n: int, memo: list | None = None) -> list[bytes]:
        """The chained digests of the first n full pages of tokens; memo (a request's list) is extended in place,
        so each page of a request is hashed once however often it is looked up or snapshotted."""
        memo = [] if memo is None else memo
        if len(memo) < n:
            ps, have = self.ps, len(memo)
            raw = np.asarray(tokens[have * ps:n * ps], np.int32).tobytes()
            parent = memo[-1] if memo else self.root.digest
            for i in range(n - have):
                parent = page_digest(parent, raw[4 * i * ps:4 * (i + 1) * ps])
                memo.append(parent)
        return memo

    def lookup(self, tokens: list[int], limit: int, memo: list | None = None) -> Hit:
        """The deepest snapshot at most `limit` tokens into `tokens` whose prefix is cached, and the chain of cached
        leading pages (only full pages ending at or before `limit`). memo: as in `digests`; pages are hashed as the
        walk reaches them (in doubling batches), so a prompt the cache does not hold costs one digest here, not one per
        page."""
        if not self.enabled:
            return Hit(None, [])
        node, chain, best = self.root, [], None
        memo = [] if memo is None else memo
        while True:
            start = node.depth * self.ps
            for partial, snap in node.snapshots.items():
                if snap.length <= limit and (best is None or snap.length > best.length) \
                        and tuple(tokens[start:snap.length]) == partial:
                    best = snap
            end = start + self.ps
            if end > limit:
                break
            if len(memo) <= node.depth:       # hash as the walk goes, in batches doubling up to the limit
                self.digests(tokens, min(limit // self.ps, 2 * node.depth + 1), memo)
            page_tokens = tuple(tokens[start:end])
            child = self.nodes.get(memo[node.depth])
            if child is None or child.parent is not node or child.tokens != page_tokens:
                break
            node = child
            chain.append(node.page)
        return Hit(best, chain)

    def use(self, snap: Snapshot):
        """A request will resume from snap: most recently used, and never evicted until the step plan that
        restores it is made (`restored`; the plan's restores are dispatched before anything it writes)."""
        self._touch(snap)
        snap.restoring += 1

    def restored(self, snap: Snapshot):
        snap.restoring -= 1

    def _touch(self, snap: Snapshot):
        self.snapshots.pop(snap)
        self.snapshots[snap] = None

    # -- snapshots -----------------------------------------------------------------------------------------------
    def snapshot(self, slot: int, tokens: list[int], length: int, pages: list[int],
                 memo: list | None = None, nodes: list | None = None) -> Copy | None:
        """Record the state of `slot` at position `length` (its K/V in `pages`, a request's page table; tokens:
        at least its first `length` token ids; memo: as in `digests`) as a snapshot: registers its full pages and
        returns the device copy to make, or None (cache off, already cached, or no room). nodes (a request's list,
        extended in place): the nodes of its leading pages found or registered here, so that its next snapshot
        walks only the pages after them; a node joins it only while its page is the request's own (pages[i]),
        which the request's ref keeps cached."""
        if not self.enabled or length < 1:
            return None
        ps = self.ps
        full = length // ps
        nodes = [] if nodes is None else nodes
        known = min(len(nodes), full)
        node, chain = (nodes[known - 1] if known else self.root), pages[:known]
        digests = self.digests(tokens, full, memo)
        for i in range(known, full):          # find or register the chain of full pages
            page_tokens = tuple(tokens[i * ps:(i + 1) * ps])
            digest = digests[i]
            child = self.nodes.get(digest)
            if child is None or child.parent is not node or child.tokens != page_tokens:
                if child is not None:         # a digest collision: leave the older entry, cache nothing here
                    return None
                child = Node(digest, node, page_tokens, pages[i], i + 1)
                self.nodes[digest], self.by_page[pages[i]] = child, child
            if len(nodes) == i and child.page == pages[i]:
                nodes.append(child)
            node = child
            chain.append(node.page)
        partial = tuple(tokens[full * ps:length])
        old = node.snapshots.get(partial)
        if old is not None:
            self._touch(old)
            return None
        self._ref(chain, snap=True)           # pin the chain before evicting anything for the entry / page
        entry = self._take_entry()
        page = 0
        if entry and partial:
            got = self.allocate(1)
            page = got[0] if got else 0
            if not page:
                self.free_entries.append(entry)
                entry = 0
        if not entry:
            self._unref(chain, snap=True)
            return None
        if page:
            self.snap_refs[page] += 1
            self._update(np.array([page], np.intp))
        snap = Snapshot(entry, node, partial, length, chain, page)
        node.snapshots[partial] = snap
        self.snapshots[snap] = None
        return Copy(slot, entry, pages[full] if page else 0, page)

    def _take_entry(self) -> int:
        if not self.free_entries and not self._evict_one():
            return 0
        return self.free_entries.pop()

    def _evict_one(self) -> bool:
        """Drop the least recently used snapshot not awaiting a restore; False if there is none."""
        for snap in self.snapshots:
            if not snap.restoring:
                self._drop(snap)
                return True
        return False

    def _drop(self, snap: Snapshot):
        del self.snapshots[snap]
        del snap.node.snapshots[snap.partial]
        self.free_entries.append(snap.entry)
        self._unref(snap.pages + ([snap.page] if snap.page else []), snap=True)

    def reset(self) -> bool:
        """Drop every snapshot (vLLM's reset_prefix_cache); False if some restore is still to be dispatched."""
        busy = [s for s in self.snapshots if s.restoring]
        for snap in [s for s in self.snapshots if not s.restoring]:
            self._drop(snap)
        return not busy

    @property
    def num_snapshots(self) -> int:
        return len(self.snapshots)


def prefix_bits(tokens, words: int) -> np.ndarray:
    """int32 [words] bitmask of the token ids present in `tokens` (bit t % 32 of word t // 32)."""
    bits = np.zeros(words, np.uint32)
    t = np.asarray(tokens, np.int64)
    np.bitwise_or.at(bits, t >> 5, np.left_shift(np.uint32(1), (t & 31).astype(np.uint32)))
    return bits.view(np.int32)
