"""The host-memory prompt cache's bookkeeping (pure Python + numpy, no torch).

The runner holds a pool of `num_blocks` host blocks, allocated once; each holds the K/V
of `block` consecutive tokens of every layer. This table decides which pool block holds
what; the runner only copies (slot -> pool on a save, pool -> slot on a restore).

Rules:
- A full block is keyed by the chained block hash of the prefix it ends
  (`native.block_hashes`: hash i covers tokens[:(i+1)*block]), so a prefix shared by many
  conversations (an agent's system prompt and tools) is stored once, whoever saved it.
  Its tokens are kept too and compared on every match: a hash collision costs a miss,
  never wrong K/V.
- A snapshot is a partial block: the K/V of the tokens past a prompt's last full block,
  saved at the end of each prompt, so a next turn that shares the prompt but not the
  generated text resumes from the prompt's end, not from its last full block. It is keyed
  by its parent (the last full block's hash, or ROOT) and its tokens, and is not stored
  when a full block under the same parent already starts with its tokens.
- Parent links: an entry is stored only while its parent is (its refcount `children`
  counts the entries stored under it), so every stored chain is reachable from ROOT.
  Every use touches a chain from its end back to ROOT, so a parent is always more
  recently used than its children and the least recently used entry is a leaf; eviction
  takes the least recently used entry with no children that the current operation did
  not touch, so a save never evicts the chain it is extending.
- Blocks a planned restore reads are pinned until the next plan: a save in the same plan
  (copied first) must not reuse them.
- The cap holds at all times: no more than `num_blocks` entries ever exist; a save that
  finds nothing evictable stores fewer blocks.
- Matching is token exact past the last full block: among the entries stored under the
  last matched block, the one sharing the most leading tokens with the prompt extends
  the match (a partial block's K/V of its first j tokens is exact: attention is causal).
"""
from __future__ import annotations

import collections
from typing import NamedTuple, Optional

import numpy as np

ROOT = "root"  # the parent of every chain's first block


class _Entry:
    __slots__ = ("key", "parent", "index", "length", "children", "op")

    def __init__(self, key, parent, index: int, length: int, op: int) -> None:
        self.key = key
        self.parent = parent  # ROOT or the key of the full block before it
        self.index = index  # pool block
        self.length = length  # tokens held: block for a full block, fewer for a snapshot
        self.children = 0  # entries stored under it
        self.op = op  # the operation that touched it last


class Save(NamedTuple):
    """Copy the slot's K/V of tokens [start, start + len(blocks) * block) into these pool
    blocks, in order (the last one may be a snapshot that holds fewer tokens)."""

    slot: int
    start: int
    blocks: tuple[int, ...]


class Match(NamedTuple):
    tokens: int  # leading prompt tokens whose K/V the pool holds
    blocks: tuple[int, ...]  # pool blocks holding tokens [0, len(blocks) * block), in order


NO_MATCH = Match(0, ())


class HostCache:
    def __init__(self, num_blocks: int, block: int, block_bytes: int, max_tokens: int) -> None:
        """num_blocks pool blocks of `block` tokens, `block_bytes` each; a save never
        reaches past position `max_tokens` (the slot's KV capacity)."""
        if num_blocks < 1 or block < 1:
            raise ValueError("a host cache needs num_blocks >= 1 and block >= 1")
        self.num_blocks = num_blocks
        self.block = block
        self.block_bytes = block_bytes
        self.max_tokens = max_tokens
        self.tokens = np.zeros((num_blocks, block), dtype=np.int32)  # [num_blocks, block]
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self.entries: collections.OrderedDict = collections.OrderedDict()  # key -> _Entry, LRU first
        self.kids: dict = collections.defaultdict(set)  # parent key -> keys stored under it
        self._op = 0
        # pool blocks a planned restore reads: not evicted until the plan ran (the
        # runner copies a plan's saves before its restores); `unpin` when planning anew
        self.pinned: set[int] = set()
        self.num_snapshots = 0
        # counters
        self.evictions = 0  # entries removed to make room (the cap held)
        self.hits = 0  # restores
        self.hit_tokens = 0  # prompt tokens restored
        self.saved_blocks = 0  # pool blocks written

    # -- queries ------------------------------------------------------------------------

    @property
    def cap_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of full blocks, each stored once."""
        return (len(self.entries) - self.num_snapshots) * self.block_bytes

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of snapshots (partial blocks), which host_bytes does not count."""
        return self.num_snapshots * self.block_bytes

    def match(self, prompt: np.ndarray, hashes: list, limit: int) -> Match:
        """The longest prefix of `prompt` (int32[n]) the pool holds, at most `limit`
        tokens; `hashes` are its chained block hashes. Touches what it matched but
        counts nothing (`count_hit` does, once the restore is planned)."""
        B = self.block
        parent, chain = ROOT, []
        for i, h in enumerate(hashes):
            e = self.entries.get(h)
            if e is None or e.length != B or e.parent != parent \
                    or not np.array_equal(self.tokens[e.index], prompt[i * B : (i + 1) * B]):
                break
            chain.append(e)
            parent = h
        n = len(chain) * B
        rest = prompt[n : n + B]
        best, best_n = None, 0
        for key in self.kids.get(parent, ()):
            e = self.entries[key]
            m = min(e.length, len(rest))
            diff = np.flatnonzero(self.tokens[e.index, :m] != rest[:m])
            j = int(diff[0]) if len(diff) else m
            if j > best_n:
                best, best_n = e, j
        if best is not None:
            chain.append(best)
            n += best_n
        n = min(n, limit)
        if n <= 0:
            return NO_MATCH
        chain = chain[: -(-n // B)]
        self._op += 1
        self._touch(chain)
        blocks = tuple(e.index for e in chain)
        self.pinned.update(blocks)
        return Match(n, blocks)

    def unpin(self) -> None:
        """The restores planned so far have run."""
        self.pinned.clear()

    def count_hit(self, match: Match) -> None:
        self.hits += 1
        self.hit_tokens += match.tokens

    # -- changes ------------------------------------------------------------------------

    def plan_save(self, slot: int, tokens: np.ndarray, hashes: list) -> Optional[Save]:
        """Store what the pool lacks of a slot's first len(tokens) tokens (int32[n], their
        K/V computed; `hashes` their chained block hashes): the full blocks, then the
        tokens past the last one as a snapshot. None when there is nothing to copy."""
        B = self.block
        self._op += 1
        op = self._op
        parent, have = ROOT, []
        for i, h in enumerate(hashes):
            e = self.entries.get(h)
            if e is None or e.length != B or e.parent != parent \
                    or not np.array_equal(self.tokens[e.index], tokens[i * B : (i + 1) * B]):
                break
            have.append(e)
            parent = h
        self._touch(have)  # marks the chain this save extends: never evicted by it
        start = len(have) * B
        new: list[_Entry] = []
        for i in range(len(have), len(hashes)):
            block_tokens = tokens[i * B : (i + 1) * B]
            if hashes[i] in self.entries:  # a colliding hash: stop rather than overwrite
                break
            self._drop_covered_snapshots(parent, block_tokens)
            e = self._add(hashes[i], parent, block_tokens, op)
            if e is None:
                break
            new.append(e)
            parent = hashes[i]
        else:
            tail = tokens[len(hashes) * B :]
            end = len(hashes) * B + B
            if len(tail) and end <= self.max_tokens and not self._covered(parent, tail):
                e = self._add(("snapshot", parent, tail.tobytes()), parent, tail, op)
                if e is not None:
                    self.num_snapshots += 1
                    new.append(e)
        if not new:
            return None
        self._touch(new)
        self.saved_blocks += len(new)
        return Save(slot, start, tuple(e.index for e in new))

    def clear(self) -> None:
        """Forget everything (the pool's contents can no longer be trusted)."""
        self.entries.clear()
        self.kids.clear()
        self.num_snapshots = 0
        self.pinned.clear()
        self.free = list(range(self.num_blocks - 1, -1, -1))

    # -- helpers ------------------------------------------------------------------------

    def _touch(self, chain: list) -> None:
        """Most recently used: the chain's end first, ROOT's child last, so parents stay
        newer than their children."""
        for e in reversed(chain):
            e.op = self._op
            self.entries.move_to_end(e.key)

    def _covered(self, parent, tail: np.ndarray) -> bool:
        """An entry under `parent` already starts with `tail`."""
        for key in self.kids.get(parent, ()):
            e = self.entries[key]
            if e.length >= len(tail) and np.array_equal(self.tokens[e.index, : len(tail)], tail):
                return True
        return False

    def _drop_covered_snapshots(self, parent, block_tokens: np.ndarray) -> None:
        """A full block now holds what these snapshots held: free them."""
        for key in list(self.kids.get(parent, ())):
            e = self.entries[key]
            if e.length < self.block and np.array_equal(self.tokens[e.index, : e.length],
                                                         block_tokens[: e.length]):
                self._remove(e)

    def _add(self, key, parent, block_tokens: np.ndarray, op: int) -> Optional[_Entry]:
        if not self.free and not self._evict_one(op):
            return None
        index = self.free.pop()
        e = _Entry(key, parent, index, len(block_tokens), op)
        self.tokens[index, : len(block_tokens)] = block_tokens
        self.entries[key] = e
        self.kids[parent].add(key)
        if parent != ROOT:
            self.entries[parent].children += 1
        return e

    def _evict_one(self, op: int) -> bool:
        for e in self.entries.values():  # least recently used first
            if e.children == 0 and e.op != op and e.index not in self.pinned:
                self._remove(e)
                self.evictions += 1
                return True
        return False

    def _remove(self, e: _Entry) -> None:
        assert e.children == 0, "an entry with children would orphan them"
        del self.entries[e.key]
        kids = self.kids[e.parent]
        kids.discard(e.key)
        if not kids:
            del self.kids[e.parent]
        if e.parent != ROOT:
            self.entries[e.parent].children -= 1
        if e.length < self.block:
            self.num_snapshots -= 1
        self.kids.pop(e.key, None)
        self.free.append(e.index)
