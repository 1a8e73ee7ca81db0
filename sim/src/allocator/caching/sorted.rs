//! `SortedSet`: an ordered map from keys to block indices, stored as a short list of sorted chunks (a B-tree
//! of height two with contiguous nodes).
//!
//! The block search is the hottest path of a replay. Pools usually hold tens to a few thousand free blocks;
//! for those sizes a binary search over one or a few contiguous sorted arrays beats `BTreeMap`'s pointer
//! chasing several times over, while the chunking keeps inserts and removes O(√n)-ish memmoves even for
//! pathological pools of hundreds of thousands of blocks. Emptied chunks are kept for reuse, so steady-state
//! operation allocates nothing.
//!
//! *Invariant:* every chunk is non-empty and sorted, chunks are in key order, `maxes[i]` is the last key of
//! `chunks[i]`, and keys are unique.

/// Entries per chunk before it is split in two.
const CHUNK: usize = 32;

/// An ordered map `K → u32` with `lower_bound` search.
#[derive(Clone, Debug)]
pub(crate) struct SortedSet<K> {
    chunks: Vec<Vec<(K, u32)>>,
    maxes: Vec<K>,
    /// Emptied chunks kept for reuse.
    spare: Vec<Vec<(K, u32)>>,
}

impl<K> Default for SortedSet<K> {
    fn default() -> Self {
        SortedSet {
            chunks: Vec::new(),
            maxes: Vec::new(),
            spare: Vec::new(),
        }
    }
}

/// A position: chunk index and index within it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pos {
    chunk: usize,
    at: usize,
}

impl<K: Ord + Copy> SortedSet<K> {
    /// Number of entries.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }

    /// The position of the first entry with a key ≥ `key` (`chunk == chunks.len()` if none).
    #[inline]
    fn lower_bound_pos(&self, key: K) -> Pos {
        let chunk = self.maxes.partition_point(|m| *m < key);
        if chunk == self.chunks.len() {
            return Pos { chunk, at: 0 };
        }
        let at = self.chunks[chunk].partition_point(|e| e.0 < key);
        Pos { chunk, at }
    }

    /// Inserts `key → value`; returns false (and changes nothing) if the key is present.
    #[inline]
    pub fn insert(&mut self, key: K, value: u32) -> bool {
        if self.chunks.is_empty() {
            let mut chunk = self.spare.pop().unwrap_or_default();
            chunk.push((key, value));
            self.chunks.push(chunk);
            self.maxes.push(key);
            return true;
        }
        // Into the first chunk whose max is ≥ key, or the last chunk.
        let ci = self
            .maxes
            .partition_point(|m| *m < key)
            .min(self.chunks.len() - 1);
        let chunk = &mut self.chunks[ci];
        let at = chunk.partition_point(|e| e.0 < key);
        if at < chunk.len() && chunk[at].0 == key {
            return false;
        }
        chunk.insert(at, (key, value));
        if at + 1 == chunk.len() {
            self.maxes[ci] = key;
        }
        if chunk.len() > CHUNK {
            let mut upper = self.spare.pop().unwrap_or_default();
            let chunk = &mut self.chunks[ci];
            upper.extend_from_slice(&chunk[CHUNK / 2..]);
            chunk.truncate(CHUNK / 2);
            self.maxes[ci] = chunk[chunk.len() - 1].0;
            let upper_max = upper[upper.len() - 1].0;
            self.chunks.insert(ci + 1, upper);
            self.maxes.insert(ci + 1, upper_max);
        }
        true
    }

    /// Removes `key`; returns its value if it was present.
    #[inline]
    pub fn remove(&mut self, key: K) -> Option<u32> {
        let pos = self.lower_bound_pos(key);
        if pos.chunk == self.chunks.len() || self.chunks[pos.chunk][pos.at].0 != key {
            return None;
        }
        Some(self.remove_at(pos))
    }

    /// Removes the entry at `pos` (from [`Ascending::last_position`]) and returns its value.
    #[inline]
    pub fn remove_at(&mut self, pos: Pos) -> u32 {
        let Pos { chunk: ci, at } = pos;
        let chunk = &mut self.chunks[ci];
        let (_, value) = chunk.remove(at);
        if chunk.is_empty() {
            let empty = self.chunks.remove(ci);
            self.maxes.remove(ci);
            self.spare.push(empty);
        } else if at == chunk.len() {
            self.maxes[ci] = chunk[at - 1].0;
        }
        value
    }

    /// Entries with key ≥ `key`, ascending (`lower_bound`).
    #[inline]
    pub fn from(&self, key: K) -> Ascending<'_, K> {
        Ascending {
            set: self,
            pos: self.lower_bound_pos(key),
            last: Pos { chunk: 0, at: 0 },
        }
    }

    /// Entries with key < `key`, descending (the walk down from the largest block below a key).
    pub fn below_descending(&self, key: K) -> Descending<'_, K> {
        Descending {
            set: self,
            pos: self.lower_bound_pos(key),
        }
    }

    /// Every entry, ascending.
    pub fn iter(&self) -> impl Iterator<Item = (K, u32)> + '_ {
        self.chunks.iter().flat_map(|c| c.iter().copied())
    }
}

/// Ascending iteration from a position.
pub(crate) struct Ascending<'a, K> {
    set: &'a SortedSet<K>,
    pos: Pos,
    last: Pos,
}

impl<K> Ascending<'_, K> {
    /// Where the item last returned by `next` is (valid until the set changes).
    #[inline]
    pub fn last_position(&self) -> Pos {
        self.last
    }
}

impl<K: Copy> Iterator for Ascending<'_, K> {
    type Item = (K, u32);

    #[inline]
    fn next(&mut self) -> Option<(K, u32)> {
        let chunk = self.set.chunks.get(self.pos.chunk)?;
        let item = chunk[self.pos.at];
        self.last = self.pos;
        self.pos.at += 1;
        if self.pos.at == chunk.len() {
            self.pos = Pos {
                chunk: self.pos.chunk + 1,
                at: 0,
            };
        }
        Some(item)
    }
}

/// Descending iteration from just before a position.
pub(crate) struct Descending<'a, K> {
    set: &'a SortedSet<K>,
    pos: Pos,
}

impl<K: Copy> Iterator for Descending<'_, K> {
    type Item = (K, u32);

    #[inline]
    fn next(&mut self) -> Option<(K, u32)> {
        if self.pos.at == 0 {
            if self.pos.chunk == 0 {
                return None;
            }
            self.pos.chunk -= 1;
            self.pos.at = self.set.chunks[self.pos.chunk].len();
        }
        self.pos.at -= 1;
        Some(self.set.chunks[self.pos.chunk][self.pos.at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn matches_btreemap_under_random_operations() {
        let mut set = SortedSet::<u64>::default();
        let mut reference = BTreeMap::new();
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 600;
            match x % 3 {
                0 => assert_eq!(set.remove(key), reference.remove(&key)),
                _ => {
                    assert_eq!(set.insert(key, step), !reference.contains_key(&key));
                    reference.entry(key).or_insert(step);
                }
            }
            assert_eq!(set.len(), reference.len());
            let probe = (x >> 20) % 610;
            assert_eq!(
                set.from(probe).next(),
                reference.range(probe..).next().map(|(k, v)| (*k, *v))
            );
            if step % 7 == 0 {
                let mut it = set.from(probe);
                if let Some((k, v)) = it.next() {
                    let pos = it.last_position();
                    assert_eq!(set.remove_at(pos), v);
                    reference.remove(&k);
                }
            }
            assert_eq!(
                set.below_descending(probe).next(),
                reference.range(..probe).next_back().map(|(k, v)| (*k, *v))
            );
        }
        let all: Vec<_> = set.iter().collect();
        let expected: Vec<_> = reference.iter().map(|(k, v)| (*k, *v)).collect();
        assert_eq!(all, expected);
        let down: Vec<_> = set.below_descending(300).collect();
        let expected: Vec<_> = reference
            .range(..300)
            .rev()
            .map(|(k, v)| (*k, *v))
            .collect();
        assert_eq!(down, expected);
    }
}
