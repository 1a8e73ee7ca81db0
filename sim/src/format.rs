//! PyTorch's `format_size` (fact sheet §6.3), used by OOM messages.
//!
//! PyTorch writes `bytes / 1024.0` (a double) to a stream set to `std::fixed` with precision 2; Rust's
//! `{:.2}` prints the same digits. Both round the exact binary value of the double to two decimals, and an
//! exact tie goes to the even digit: 1,152 B = 1.125 KiB prints "1.12 KiB" in both, 1,408 B = 1.375 KiB
//! "1.38 KiB" (checked against glibc's `printf("%.2f")`, which `std::fixed` uses).

/// Formats a byte count as PyTorch's OOM messages do: `"1024 bytes"`, `"1.00 KiB"`, `"20.00 MiB"`,
/// `"79.11 GiB"`. Boundaries are inclusive (1024 → bytes, 1 MiB → KiB, 1 GiB → MiB).
pub fn format_size(bytes: u64) -> String {
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    const GIB: u64 = 1024 * MIB;
    // §6.3 each unit up to and including 1024 of it.
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

#[cfg(test)]
mod tests {
    use super::format_size;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn unit_boundaries_are_inclusive() {
        // §6.3 worked boundaries.
        for (bytes, text) in [
            (0, "0 bytes"),
            (1, "1 bytes"),
            (KIB, "1024 bytes"),
            (KIB + 1, "1.00 KiB"),
            (MIB, "1024.00 KiB"),
            (MIB + 1, "1.00 MiB"),
            (GIB, "1024.00 MiB"),
            (GIB + 1, "1.00 GiB"),
            (20 * MIB, "20.00 MiB"),
            // §13 case 5: test_out_of_memory's "Tried to allocate 800000000.00 GiB".
            (800_000_000 * GIB, "800000000.00 GiB"),
            // NVML's "value not available" (u64::MAX) as printed in a real 2.x OOM message:
            // "this process has 17179869184.00 GiB memory in use".
            (u64::MAX, "17179869184.00 GiB"),
        ] {
            assert_eq!(format_size(bytes), text, "{bytes} bytes");
        }
    }

    #[test]
    fn rounding_matches_cpp_fixed_precision_2() {
        // Expected texts are glibc's printf("%.2f", bytes / unit), which is what
        // `std::ostringstream << std::fixed << std::setprecision(2)` prints.
        for (bytes, text) in [
            (1152, "1.12 KiB"),          // 1.125 exactly: tie to even
            (1408, "1.38 KiB"),          // 1.375 exactly: tie to even
            (1034, "1.01 KiB"),          // 1.009765625: no tie
            (1029, "1.00 KiB"),          // 1.0048828125
            (MIB + 5 * KIB, "1.00 MiB"), // 1.0048828125
            (MIB + 10 * KIB + 256, "1.01 MiB"),
            (3 * GIB + GIB / 8, "3.12 GiB"), // 3.125: tie to even
            (GIB + 5 * MIB, "1.00 GiB"),     // 1.0048828125
            (85_017_755_648, "79.18 GiB"),
            (10_485_759, "10.00 MiB"),
        ] {
            assert_eq!(format_size(bytes), text, "{bytes} bytes");
        }
    }
}
