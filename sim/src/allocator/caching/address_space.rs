//! The simulated virtual address space: where `cudaMalloc` and `cuMemAddressReserve` put things.
//!
//! Addresses only need to be unique, ordered and deterministic: PyTorch's behaviour depends on address
//! order (ties in best fit, the `unmapped` set) but never on the values. A bump pointer that never reuses
//! addresses, starting at a typical CUDA user address and aligned to the 2 MiB granularity of the driver,
//! gives all three.

/// Where the first segment goes (a typical CUDA device pointer on Linux x86-64).
pub const ADDRESS_SPACE_START: u64 = 0x7f00_0000_0000;
/// Alignment of every reservation: the driver's 2 MiB allocation granularity.
pub const ADDRESS_ALIGNMENT: u64 = 2 << 20;

/// A bump allocator of virtual addresses.
#[derive(Clone, Debug)]
pub struct AddressSpace {
    next: u64,
}

impl Default for AddressSpace {
    fn default() -> Self {
        AddressSpace {
            next: ADDRESS_SPACE_START,
        }
    }
}

impl AddressSpace {
    /// Reserves `bytes` (> 0) and returns the 2 MiB-aligned start of the range.
    #[inline]
    pub fn reserve(&mut self, bytes: u64) -> u64 {
        let addr = self.next;
        let span = bytes.max(1).div_ceil(ADDRESS_ALIGNMENT) * ADDRESS_ALIGNMENT;
        self.next = self
            .next
            .checked_add(span)
            .expect("simulated address space exhausted");
        addr
    }
}
