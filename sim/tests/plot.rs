//! Timeline plots (`sim/src/plot.rs`): files are written, are what their extension says, and
//! downsampling keeps peaks.

use std::path::PathBuf;

use vramsim_sim::plot::{downsample, plot_timeline, PlotError, TimelinePlot, TimelineSample};

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

/// A training-like timeline: weights, then per step a forward ramp, a backward fall and an optimizer
/// bump; reserved memory follows the high-water mark.
fn synthetic(steps: usize, points_per_step: usize) -> Vec<TimelineSample> {
    let mut samples = Vec::new();
    let mut reserved = 0;
    for step in 0..steps {
        for i in 0..points_per_step {
            let t = i as f64 / points_per_step as f64;
            let activations = if t < 0.5 { t * 2.0 } else { (1.0 - t) * 2.0 };
            let allocated =
                20 * GIB + (40.0 * GIB as f64 * activations) as u64 + (step as u64 * 64 * MIB);
            reserved = reserved.max(allocated + 2 * GIB);
            samples.push(TimelineSample {
                x: (step * points_per_step + i) as f64,
                allocated,
                reserved,
            });
        }
    }
    samples
}

fn phases(steps: usize, points_per_step: usize) -> Vec<(f64, String)> {
    (0..steps)
        .flat_map(|step| {
            let base = (step * points_per_step) as f64;
            let n = points_per_step as f64;
            [
                (base, format!("forward {step}")),
                (base + 0.5 * n, format!("backward {step}")),
                (base + 0.9 * n, "optimizer".to_string()),
            ]
        })
        .collect()
}

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vramsim-plot-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn renders_png_and_svg() {
    let samples = synthetic(4, 5_000);
    let phases = phases(4, 5_000);
    let plot = TimelinePlot {
        title: "synthetic · pytorch (expandable_segments:False)",
        x_label: "event",
        samples: &samples,
        capacity: Some(79 * GIB),
        oom_at: Some(17_500.0),
        phases: &phases,
    };
    let dir = temp_dir("render");

    let png = dir.join("timeline.png");
    plot_timeline(&plot, &png).unwrap();
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.len() > 10_000, "PNG is only {} bytes", bytes.len());
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");

    let svg = dir.join("timeline.SVG");
    plot_timeline(&plot, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.trim_start().starts_with("<svg"),
        "{}",
        &text[..80.min(text.len())]
    );
    assert!(text.trim_end().ends_with("</svg>"));
    for expected in [
        "capacity 79.00 GiB",
        "out of memory",
        "forward 0",
        "allocated (peak",
    ] {
        assert!(text.contains(expected), "SVG lacks {expected:?}");
    }

    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn renders_small_timelines_without_extras() {
    // Below 1 GiB the axis is in MiB; a single sample still gets a non-empty x range.
    let samples = [TimelineSample {
        x: 3.0,
        allocated: 300 * MIB,
        reserved: 320 * MIB,
    }];
    let plot = TimelinePlot {
        title: "one sample",
        x_label: "time (ms)",
        samples: &samples,
        capacity: None,
        oom_at: None,
        phases: &[],
    };
    let dir = temp_dir("small");
    let svg = dir.join("one.svg");
    plot_timeline(&plot, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.contains("memory (MiB)"));
    assert!(!text.contains("out of memory"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn refuses_unknown_extensions_and_empty_timelines() {
    let samples = synthetic(1, 10);
    let plot = TimelinePlot {
        title: "t",
        x_label: "event",
        samples: &samples,
        capacity: None,
        oom_at: None,
        phases: &[],
    };
    let dir = temp_dir("errors");
    for name in ["timeline.jpg", "timeline"] {
        let err = plot_timeline(&plot, &dir.join(name)).unwrap_err();
        assert!(matches!(err, PlotError::UnsupportedFormat { .. }), "{err}");
        let message = err.to_string();
        assert!(
            message.contains(".png") && message.contains(".svg"),
            "{message}"
        );
        assert!(!dir.join(name).exists());
    }
    let empty = TimelinePlot {
        samples: &[],
        ..plot
    };
    assert!(matches!(
        plot_timeline(&empty, &dir.join("empty.png")),
        Err(PlotError::NoSamples)
    ));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn downsample_keeps_peaks() {
    let samples = synthetic(3, 1_000);
    let peak_allocated = samples.iter().map(|s| s.allocated).max().unwrap();
    let peak_reserved = samples.iter().map(|s| s.reserved).max().unwrap();
    for max_points in [1, 7, 100, 2_999] {
        let reduced = downsample(&samples, max_points);
        assert_eq!(reduced.len(), max_points);
        assert_eq!(
            reduced.iter().map(|s| s.allocated).max(),
            Some(peak_allocated)
        );
        assert_eq!(
            reduced.iter().map(|s| s.reserved).max(),
            Some(peak_reserved)
        );
        assert!(
            reduced.windows(2).all(|w| w[0].x < w[1].x),
            "x stays increasing"
        );
    }
    // Each step's spike survives a reduction to a handful of points per step.
    let reduced = downsample(&samples, 30);
    for step in 0..3 {
        let step_peak = samples[step * 1_000..(step + 1) * 1_000]
            .iter()
            .map(|s| s.allocated)
            .max()
            .unwrap();
        assert!(
            reduced.iter().any(|s| s.allocated == step_peak),
            "step {step}"
        );
    }
}

#[test]
fn downsample_edge_cases() {
    let samples = synthetic(1, 10);
    assert_eq!(downsample(&samples, 10), samples);
    assert_eq!(downsample(&samples, 50), samples);
    assert!(downsample(&samples, 0).is_empty());
    assert!(downsample(&[], 5).is_empty());
}
