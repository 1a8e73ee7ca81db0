//! Shapes and strides: which view ops can share storage and which must copy.
//!
//! PyTorch decides at run time whether `view`/`reshape` can alias the input (`computeStride` in
//! `aten/src/ATen/TensorUtils.cpp`) and which strides an elementwise result gets (TensorIterator's
//! `reorder_dimensions`). Both decide whether bytes are allocated, so the lowering tracks strides
//! exactly as PyTorch does; storage offsets never change a size and are not tracked.

use std::fmt;
use std::ops::{Deref, DerefMut};

/// Dimensions a [`Dims`] holds without a heap allocation (a tensor of more goes to the heap). Four
/// covers the weights, activations and attention scores of the zoo's models, and keeps a layout
/// small enough that copying one is cheap (six measured slower: the lowering copies layouts often).
const INLINE_DIMS: usize = 4;

/// One number per dimension of a tensor (its sizes or its strides): a slice of `u64` stored inline
/// up to four dimensions, so that the lowering's many layouts (every tensor handle, every autograd
/// node's input metadata) cost no allocation. It dereferences to `[u64]` and compares, prints and
/// converts as the `Vec<u64>` it stands for.
#[derive(Clone)]
pub struct Dims(Repr);

#[derive(Clone)]
enum Repr {
    Inline { len: u8, d: [u64; INLINE_DIMS] },
    Heap(Vec<u64>),
}

impl Dims {
    /// No dimensions (a scalar's shape).
    pub const fn new() -> Dims {
        Dims(Repr::Inline {
            len: 0,
            d: [0; INLINE_DIMS],
        })
    }

    /// `n` dimensions, each `value` (`vec![value; n]`).
    pub fn filled(value: u64, n: usize) -> Dims {
        if n <= INLINE_DIMS {
            Dims(Repr::Inline {
                len: n as u8,
                d: [value; INLINE_DIMS],
            })
        } else {
            Dims(Repr::Heap(vec![value; n]))
        }
    }

    /// A copy of `s`.
    pub fn from_slice(s: &[u64]) -> Dims {
        if s.len() <= INLINE_DIMS {
            let mut d = [0; INLINE_DIMS];
            d[..s.len()].copy_from_slice(s);
            Dims(Repr::Inline {
                len: s.len() as u8,
                d,
            })
        } else {
            Dims(Repr::Heap(s.to_vec()))
        }
    }

    /// Appends a dimension (`Vec::push`).
    pub fn push(&mut self, value: u64) {
        let n = self.len();
        self.insert(n, value);
    }

    /// Inserts a dimension at `index`, shifting the later ones (`Vec::insert`; panics past the end).
    pub fn insert(&mut self, index: usize, value: u64) {
        match &mut self.0 {
            Repr::Inline { len, d } if (*len as usize) < INLINE_DIMS => {
                let n = *len as usize;
                assert!(index <= n, "insertion index {index} past {n} dimensions");
                d.copy_within(index..n, index + 1);
                d[index] = value;
                *len += 1;
            }
            Repr::Inline { .. } => {
                let mut v = self.to_vec();
                v.insert(index, value);
                self.0 = Repr::Heap(v);
            }
            Repr::Heap(v) => v.insert(index, value),
        }
    }

    /// Removes and returns the dimension at `index`, shifting the later ones (`Vec::remove`).
    pub fn remove(&mut self, index: usize) -> u64 {
        match &mut self.0 {
            Repr::Inline { len, d } => {
                let n = *len as usize;
                assert!(index < n, "removal index {index} past {n} dimensions");
                let out = d[index];
                d.copy_within(index + 1..n, index);
                *len -= 1;
                out
            }
            Repr::Heap(v) => v.remove(index),
        }
    }

    /// Keeps the first `n` dimensions (`Vec::truncate`).
    pub fn truncate(&mut self, n: usize) {
        match &mut self.0 {
            Repr::Inline { len, .. } => *len = (*len).min(n as u8),
            Repr::Heap(v) => v.truncate(n),
        }
    }
}

impl Default for Dims {
    fn default() -> Dims {
        Dims::new()
    }
}

impl Deref for Dims {
    type Target = [u64];
    fn deref(&self) -> &[u64] {
        match &self.0 {
            Repr::Inline { len, d } => &d[..*len as usize],
            Repr::Heap(v) => v,
        }
    }
}

impl DerefMut for Dims {
    fn deref_mut(&mut self) -> &mut [u64] {
        match &mut self.0 {
            Repr::Inline { len, d } => &mut d[..*len as usize],
            Repr::Heap(v) => v,
        }
    }
}

impl fmt::Debug for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

impl PartialEq for Dims {
    fn eq(&self, other: &Dims) -> bool {
        **self == **other
    }
}

impl Eq for Dims {}

impl PartialEq<[u64]> for Dims {
    fn eq(&self, other: &[u64]) -> bool {
        **self == *other
    }
}

impl PartialEq<Vec<u64>> for Dims {
    fn eq(&self, other: &Vec<u64>) -> bool {
        **self == **other
    }
}

impl<const N: usize> PartialEq<[u64; N]> for Dims {
    fn eq(&self, other: &[u64; N]) -> bool {
        **self == *other
    }
}

impl From<&[u64]> for Dims {
    fn from(s: &[u64]) -> Dims {
        Dims::from_slice(s)
    }
}

impl From<Vec<u64>> for Dims {
    fn from(v: Vec<u64>) -> Dims {
        if v.len() <= INLINE_DIMS {
            Dims::from_slice(&v)
        } else {
            Dims(Repr::Heap(v))
        }
    }
}

impl<const N: usize> From<[u64; N]> for Dims {
    fn from(a: [u64; N]) -> Dims {
        Dims::from_slice(&a)
    }
}

impl From<Dims> for Vec<u64> {
    fn from(d: Dims) -> Vec<u64> {
        match d.0 {
            Repr::Inline { len, d } => d[..len as usize].to_vec(),
            Repr::Heap(v) => v,
        }
    }
}

impl FromIterator<u64> for Dims {
    fn from_iter<I: IntoIterator<Item = u64>>(iter: I) -> Dims {
        let mut out = Dims::new();
        for x in iter {
            out.push(x);
        }
        out
    }
}

impl<'a> IntoIterator for &'a Dims {
    type Item = &'a u64;
    type IntoIter = std::slice::Iter<'a, u64>;
    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// The sizes and element strides of a tensor (no storage offset: it never changes a byte count).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Sizes, outermost first.
    pub shape: Dims,
    /// Strides in elements, one per dimension.
    pub strides: Dims,
}

/// The row-major strides of `shape` (`c10::contiguous_strides`).
pub fn contiguous_strides(shape: &[u64]) -> Dims {
    let mut strides = Dims::filled(1, shape.len());
    let mut acc = 1u64;
    for d in (0..shape.len()).rev() {
        strides[d] = acc;
        acc = acc.saturating_mul(shape[d].max(1));
    }
    strides
}

/// The number of elements of `shape` (saturating; the lowering checks overflow separately).
pub fn numel(shape: &[u64]) -> u64 {
    shape.iter().fold(1u64, |a, &d| a.saturating_mul(d))
}

impl Layout {
    /// A contiguous (row-major) layout of `shape`.
    pub fn contiguous(shape: &[u64]) -> Layout {
        Layout {
            shape: Dims::from_slice(shape),
            strides: contiguous_strides(shape),
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        numel(&self.shape)
    }

    /// Number of dimensions.
    pub fn dim(&self) -> usize {
        self.shape.len()
    }

    /// `Tensor.is_contiguous()`: size-1 dimensions may have any stride.
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1u64;
        for d in (0..self.shape.len()).rev() {
            let s = self.shape[d];
            if s == 0 {
                return true;
            }
            if s != 1 {
                if self.strides[d] != expected {
                    return false;
                }
                expected *= s;
            }
        }
        true
    }

    /// `is_non_overlapping_and_dense`: some permutation of the dimensions is contiguous.
    pub fn is_non_overlapping_and_dense(&self) -> bool {
        with_iota(self.dim(), |perm| {
            perm.sort_by(|&a, &b| {
                // size-1 dims sort last (they never matter)
                (self.shape[a] == 1)
                    .cmp(&(self.shape[b] == 1))
                    .then(self.strides[a].cmp(&self.strides[b]))
            });
            let mut expected = 1u64;
            for &d in perm.iter() {
                let s = self.shape[d];
                if s == 1 {
                    continue;
                }
                if self.strides[d] != expected {
                    return false;
                }
                expected *= s;
            }
            true
        })
    }

    /// `view(shape)`: the strides of the aliasing view, or `None` when the memory cannot be viewed
    /// that way (ATen `computeStride`; `reshape` then copies).
    pub fn view_strides(&self, new_shape: &[u64]) -> Option<Dims> {
        let old_shape = &self.shape;
        let old_stride = &self.strides;
        let mut new_stride = Dims::filled(0, new_shape.len());
        if old_shape.is_empty() {
            return Some(Dims::filled(1, new_shape.len()));
        }
        if self.numel() == 0 {
            return Some(contiguous_strides(new_shape));
        }
        let mut view_d = new_shape.len() as isize - 1;
        let mut chunk_base_stride = *old_stride.last().unwrap();
        let mut tensor_numel = 1u64;
        let mut view_numel = 1u64;
        for tensor_d in (0..old_shape.len()).rev() {
            tensor_numel *= old_shape[tensor_d];
            if tensor_d == 0
                || (old_shape[tensor_d - 1] != 1
                    && old_stride[tensor_d - 1] != tensor_numel * chunk_base_stride)
            {
                while view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d as usize] == 1)
                {
                    new_stride[view_d as usize] = view_numel * chunk_base_stride;
                    view_numel *= new_shape[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if tensor_d > 0 {
                    chunk_base_stride = old_stride[tensor_d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        if view_d != -1 {
            return None;
        }
        Some(new_stride)
    }

    /// `transpose(d0, d1)` (a view).
    pub fn transpose(&self, d0: usize, d1: usize) -> Layout {
        let mut l = self.clone();
        l.shape.swap(d0, d1);
        l.strides.swap(d0, d1);
        l
    }

    /// `permute(perm)` (a view).
    pub fn permute(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
        }
    }

    /// `expand(shape)` (a view: broadcast dimensions get stride 0).
    pub fn expand(&self, shape: &[u64]) -> Layout {
        let extra = shape.len() - self.dim();
        let mut strides = Dims::filled(0, shape.len());
        for (d, &s) in shape.iter().enumerate() {
            if d >= extra {
                let od = d - extra;
                strides[d] = if self.shape[od] == s {
                    self.strides[od]
                } else {
                    0
                };
            }
        }
        Layout {
            shape: Dims::from_slice(shape),
            strides,
        }
    }

    /// `narrow`/`slice` along `dim` to `len` elements (a view: strides unchanged).
    pub fn narrow(&self, dim: usize, len: u64) -> Layout {
        let mut l = self.clone();
        l.shape[dim] = len;
        l
    }

    /// `unsqueeze(dim)` (a view).
    pub fn unsqueeze(&self, dim: usize) -> Layout {
        let mut l = self.clone();
        let stride = if dim < l.dim() {
            l.shape[dim] * l.strides[dim]
        } else {
            1
        };
        l.shape.insert(dim, 1);
        l.strides.insert(dim, stride);
        l
    }

    /// `suggest_memory_format() == ChannelsLast` for a 4-D tensor: c10's
    /// `is_channels_last_strides_2d_s4` (`c10/core/MemoryFormat.h`), which walks the dimensions in
    /// the order C, W, H, N requiring non-decreasing strides and falls back to NCHW in the
    /// ambiguous cases (a zero channel stride, `N111`-like tensors whose batch stride equals the
    /// channel stride). Contiguous NCHW tensors, including `[O, I, 1, 1]` and depthwise
    /// `[C, 1, k, k]` weights, are not channels-last; `x.permute(0, 3, 1, 2)` of a contiguous NHWC
    /// tensor is.
    pub fn is_channels_last_2d(&self) -> bool {
        if self.dim() != 4 || self.strides[1] == 0 {
            return false;
        }
        let mut min = 0u64;
        for d in [1usize, 3, 2, 0] {
            if self.shape[d] == 0 || self.strides[d] < min {
                return false;
            }
            if d == 0 && min == self.strides[1] {
                return false;
            }
            min = self.strides[d];
            if self.shape[d] > 1 {
                min *= self.shape[d];
            }
        }
        true
    }

    /// `is_contiguous(memory_format=torch.channels_last)` of a 4-D tensor: dense in the order
    /// N, H, W, C (size-1 dimensions may have any stride).
    pub fn is_channels_last_contiguous(&self) -> bool {
        if self.dim() != 4 {
            return false;
        }
        let mut expected = 1u64;
        for d in [1usize, 3, 2, 0] {
            let s = self.shape[d];
            if s == 0 {
                return true;
            }
            if s != 1 {
                if self.strides[d] != expected {
                    return false;
                }
                expected *= s;
            }
        }
        true
    }

    /// A channels-last layout of the 4-D `shape` (`empty(shape, memory_format=channels_last)`).
    pub fn channels_last(shape: &[u64]) -> Layout {
        dense_in_order(shape, &[0, 2, 3, 1])
    }

    /// The layout `empty_like(self)` gives with `preserve_format`: the same dimension order when
    /// the tensor is non-overlapping and dense, else contiguous.
    pub fn empty_like(&self) -> Layout {
        if self.is_non_overlapping_and_dense() {
            with_iota(self.dim(), |perm| {
                perm.sort_by(|&a, &b| self.strides[b].cmp(&self.strides[a]));
                dense_in_order(&self.shape, perm)
            })
        } else {
            Layout::contiguous(&self.shape)
        }
    }
}

/// A dense layout of `shape` whose dimensions, from outermost to innermost, are `order`.
pub fn dense_in_order(shape: &[u64], order: &[usize]) -> Layout {
    let mut strides = Dims::filled(0, shape.len());
    let mut acc = 1u64;
    for &d in order.iter().rev() {
        strides[d] = acc;
        acc *= shape[d].max(1);
    }
    Layout {
        shape: Dims::from_slice(shape),
        strides,
    }
}

/// Calls `f` with `[0, 1, .., n)` in a scratch buffer (on the stack for up to eight dimensions).
fn with_iota<R>(n: usize, f: impl FnOnce(&mut [usize]) -> R) -> R {
    const STACK: usize = 8;
    if n <= STACK {
        let mut a = [0usize; STACK];
        for (i, x) in a.iter_mut().enumerate() {
            *x = i;
        }
        f(&mut a[..n])
    } else {
        let mut v: Vec<usize> = (0..n).collect();
        f(&mut v)
    }
}

/// The stride of `l` broadcast to `shape` at dimension `d` (what `l.expand(shape).strides[d]` is,
/// without building the expanded layout).
fn expanded_stride(l: &Layout, shape: &[u64], d: usize) -> u64 {
    let extra = shape.len() - l.dim();
    if d < extra {
        return 0;
    }
    let od = d - extra;
    if l.shape[od] == shape[d] {
        l.strides[od]
    } else {
        0
    }
}

/// The layout of an elementwise result over `inputs` broadcast to `shape`: TensorIterator's
/// `reorder_dimensions` (the first operand whose strides tell two dimensions apart decides their
/// order), then dense strides in that order.
pub fn elementwise_layout(shape: &[u64], inputs: &[&Layout]) -> Layout {
    let n = shape.len();
    // The operands broadcast to `shape` (`expand`, whose strides equal the input's where the shapes
    // agree).
    let should_swap = |d0: usize, d1: usize| -> i32 {
        for op in inputs {
            let (s0, s1) = (
                expanded_stride(op, shape, d0),
                expanded_stride(op, shape, d1),
            );
            if s0 == 0 || s1 == 0 {
                continue;
            }
            if s0 < s1 {
                return -1;
            }
            if s0 > s1 {
                return 1;
            }
            if shape[d0] > shape[d1] {
                return 1;
            }
        }
        0
    };
    with_iota(n, |perm| {
        // perm[0] is the innermost (fastest) dimension, as in TensorIterator.
        perm.reverse();
        for i in 1..n {
            let mut dim1 = i;
            for dim0 in (0..i).rev() {
                let c = should_swap(perm[dim0], perm[dim1]);
                if c > 0 {
                    perm.swap(dim0, dim1);
                    dim1 = dim0;
                } else if c < 0 {
                    break;
                }
            }
        }
        // outermost first
        perm.reverse();
        dense_in_order(shape, perm)
    })
}

/// Broadcast two shapes (`infer_size`), or `None` when they do not broadcast.
pub fn broadcast(a: &[u64], b: &[u64]) -> Option<Vec<u64>> {
    let n = a.len().max(b.len());
    let mut out = vec![0u64; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db {
            da
        } else if da == 1 {
            db
        } else if db == 1 {
            da
        } else {
            return None;
        };
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_behave_as_the_vec_they_stand_for_inline_and_on_the_heap() {
        // Every operation, on both sides of the inline capacity, against Vec<u64>'s own.
        let mut d = Dims::new();
        let mut v: Vec<u64> = Vec::new();
        for x in 1..=7u64 {
            d.insert(d.len() / 2, x * 10);
            v.insert(v.len() / 2, x * 10);
            assert_eq!(d, v);
            assert_eq!(format!("{d:?}"), format!("{v:?}"));
        }
        while !v.is_empty() {
            assert_eq!(d.remove(v.len() - 1), v.remove(v.len() - 1));
            assert_eq!(d, v);
        }
        let big: Vec<u64> = (0..9).collect();
        let mut h = Dims::from(big.clone());
        assert_eq!(Vec::from(h.clone()), big);
        h.truncate(3);
        assert_eq!(h, [0, 1, 2]);
        assert_eq!(Dims::filled(7, 5), vec![7u64; 5]);
        assert_eq!(
            (0..6u64).collect::<Dims>(),
            Dims::from_slice(&[0, 1, 2, 3, 4, 5])
        );
        // A 5-D layout (ViT's qkv reshape) works as a 4-D one does.
        let l = Layout::contiguous(&[2, 197, 3, 12, 64]).permute(&[2, 0, 3, 1, 4]);
        assert_eq!(l.strides, [768, 453888, 64, 2304, 1]);
        assert!(!l.is_contiguous());
    }

    #[test]
    fn view_of_transposed_heads_needs_a_copy() {
        // [B,S,H,D] -> transpose(1,2) -> [B,H,S,D]: merging B and H is impossible.
        let l = Layout::contiguous(&[2, 128, 12, 64]).transpose(1, 2);
        assert!(l.view_strides(&[24, 128, 64]).is_none());
        // ... but [B,H,D,S] transposed back from a contiguous [B,H,S,D] merges H and D.
        let g = Layout::contiguous(&[2, 12, 64, 128])
            .transpose(2, 3)
            .transpose(1, 2);
        assert!(g.view_strides(&[2, 128, 768]).is_some());
    }

    #[test]
    fn channels_last_is_suggested_as_c10_does() {
        // LayerNorm2d: a contiguous NHWC tensor permuted to NCHW is channels-last.
        let nhwc = Layout::contiguous(&[8, 56, 56, 96]).permute(&[0, 3, 1, 2]);
        assert!(nhwc.is_channels_last_2d());
        assert!(nhwc.is_channels_last_contiguous());
        assert!(!nhwc.is_contiguous());
        assert_eq!(nhwc, Layout::channels_last(&[8, 96, 56, 56]));
        // Contiguous NCHW tensors and weights (1x1, depthwise [C, 1, k, k]) are not.
        for shape in [
            [8, 96, 56, 56],
            [256, 64, 1, 1],
            [96, 1, 7, 7],
            [8, 2048, 1, 1],
        ] {
            assert!(
                !Layout::contiguous(&shape).is_channels_last_2d(),
                "{shape:?}"
            );
        }
        // N111: ambiguous, NCHW (c10's fallback).
        assert!(!Layout::contiguous(&[8, 1, 1, 1]).is_channels_last_2d());
    }

    #[test]
    fn elementwise_follows_first_operand() {
        let q = Layout::contiguous(&[2, 128, 32, 64]).transpose(1, 2);
        let cos = Layout::contiguous(&[1, 1, 128, 64]);
        let out = elementwise_layout(&[2, 32, 128, 64], &[&q, &cos]);
        assert_eq!(out.strides, q.strides);
        assert!(!out.is_contiguous());
    }
}
