//! A snapshot's `allocator_settings` (§10.2) as the [`AllocatorConfig`] its run had: what the importer
//! sizes blocks with, and what a check or a replay of the snapshot runs under.

use vramsim_traces::snapshot::AllocatorSettings;

use crate::config::AllocatorConfig;

/// The allocator settings of a snapshot as an [`AllocatorConfig`], with where they came from.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotSettings {
    /// The configuration.
    pub config: AllocatorConfig,
    /// What it was built from, for reports.
    pub source: String,
    /// Disagreements and unreadable settings.
    pub notes: Vec<String>,
}

/// Maps a snapshot's `allocator_settings` to an [`AllocatorConfig`]: the `PYTORCH_CUDA_ALLOC_CONF` string
/// when the snapshot has a non-empty one (parsed as PyTorch parses it, §12), else the individual fields
/// (`max_split_size`, `garbage_collection_threshold`, `expandable_segments`, `roundup_power2_divisions`),
/// else PyTorch's defaults (snapshots written before PyTorch 2.2 carry no settings).
pub fn config_from_settings(settings: Option<&AllocatorSettings>) -> SnapshotSettings {
    let mut notes = Vec::new();
    let Some(s) = settings else {
        return SnapshotSettings {
            config: AllocatorConfig::default(),
            source: "defaults (the snapshot records no allocator_settings)".to_owned(),
            notes,
        };
    };
    let mut from_fields = AllocatorConfig::default();
    if let Some(m) = s.max_split_size {
        if m >= 0 {
            from_fields.max_split_size = m as u64;
        }
    }
    if let Some(t) = s.garbage_collection_threshold {
        from_fields.garbage_collection_threshold = t;
    }
    if let Some(e) = s.expandable_segments {
        from_fields.expandable_segments = e;
    }
    if let Some(divisions) = &s.roundup_power2_divisions {
        from_fields.roundup_power2_divisions = divisions_by_interval(divisions);
    }
    match s.pytorch_cuda_alloc_conf.as_deref() {
        Some(conf) if !conf.trim().is_empty() => match AllocatorConfig::parse(conf) {
            Ok(config) => {
                if config.expandable_segments != from_fields.expandable_segments
                    || config.max_split_size != from_fields.max_split_size
                    || config.roundup_power2_divisions != from_fields.roundup_power2_divisions
                {
                    notes.push(format!(
                        "allocator_settings: the fields disagree with PYTORCH_CUDA_ALLOC_CONF {conf:?}; the string is used"
                    ));
                }
                SnapshotSettings {
                    config,
                    source: format!("{conf:?} (allocator_settings.PYTORCH_CUDA_ALLOC_CONF)"),
                    notes,
                }
            }
            Err(e) => {
                notes.push(format!(
                    "allocator_settings.PYTORCH_CUDA_ALLOC_CONF {conf:?} does not parse ({e}); the fields are used"
                ));
                SnapshotSettings {
                    config: from_fields,
                    source: "the allocator_settings fields".to_owned(),
                    notes,
                }
            }
        },
        _ => SnapshotSettings {
            source: if from_fields == AllocatorConfig::default() {
                "defaults (allocator_settings: no settings string, default fields)".to_owned()
            } else {
                "the allocator_settings fields".to_owned()
            },
            config: from_fields,
            notes,
        },
    }
}

/// `allocator_settings["roundup_power2_divisions"]`, keyed by the start of each power-of-two interval in
/// MiB (`1` → entry 0, `2` → 1, ..., `32768` → 15), as the 16 entries of §12.4; other keys are ignored.
fn divisions_by_interval(divisions: &[(u64, u64)]) -> [u64; 16] {
    let mut by_interval = [0; 16];
    for &(start_mib, d) in divisions {
        if start_mib.is_power_of_two() {
            let k = (63 - start_mib.leading_zeros()) as usize;
            if k < 16 {
                by_interval[k] = d;
            }
        }
    }
    by_interval
}
