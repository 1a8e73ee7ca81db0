//! PyTorch's `format_size` (fact sheet §6.3), used by OOM messages.

/// Formats a byte count as PyTorch's OOM messages do: `"1024 bytes"`, `"1.00 KiB"`, `"20.00 MiB"`,
/// `"79.11 GiB"`. Boundaries are inclusive (1024 → bytes, 1 MiB → KiB, 1 GiB → MiB).
pub fn format_size(bytes: u64) -> String {
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    const GIB: u64 = 1024 * MIB;
    if bytes <= KIB {
        format!("{bytes} bytes")
    } else if bytes <= MIB {
        format!("{:.2} KiB", bytes as f64 / KIB as f64)
    } else if bytes <= GIB {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    }
}
