//! The what-if plots of `sim/src/plot.rs` (stacked categories over one step, a bar per configuration,
//! peak against batch size): files are written in the format their extension says, with the labels a
//! reader needs, and bad requests are refused.

use std::path::PathBuf;

use vramsim_sim::plot::{
    plot_bars, plot_category_timeline, plot_size_curve, Bar, BarPlot, CategorySample,
    CategoryTimelinePlot, PlotError, SizeCurvePlot, SizePoint,
};
use vramsim_traces::Category;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn temp_dir(tag: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("vramsim-whatif-plot-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// One training-like step: weights and optimizer state throughout, activations up in forward and down
/// in backward while gradients grow, a temporary bump in the optimizer.
fn step() -> (Vec<CategorySample>, Vec<(f64, String)>) {
    let mut samples = Vec::new();
    for i in 0..1000u64 {
        let t = i as f64 / 1000.0;
        let mut c = [0u64; Category::ALL.len()];
        c[Category::Parameter.index()] = 2 * GIB;
        c[Category::OptimizerState.index()] = 4 * GIB;
        let activation = if t < 0.4 {
            t / 0.4
        } else if t < 0.85 {
            (0.85 - t) / 0.45
        } else {
            0.0
        };
        c[Category::Activation.index()] = (10.0 * GIB as f64 * activation) as u64;
        if t > 0.4 {
            c[Category::Gradient.index()] = (2.0 * GIB as f64 * ((t - 0.4) / 0.45).min(1.0)) as u64;
        }
        if (0.85..0.95).contains(&t) {
            c[Category::Temporary.index()] = 512 * MIB;
        }
        samples.push(CategorySample {
            x: 5000.0 + i as f64,
            categories: c,
            reserved: 19 * GIB,
        });
    }
    let phases = vec![
        (5000.0, "forward".to_string()),
        (5400.0, "backward".to_string()),
        (5850.0, "optimizer".to_string()),
        (5950.0, "zero_grad".to_string()),
    ];
    (samples, phases)
}

#[test]
fn one_step_by_category() {
    let (samples, phases) = step();
    let plot = CategoryTimelinePlot {
        title: "gpt2-medium · batch 8 · amp-bf16 · one step on NVIDIA GeForce RTX 4090",
        x_label: "event",
        samples: &samples,
        capacity: Some(23 * GIB),
        oom_at: None,
        phases: &phases,
    };
    let dir = temp_dir("categories");
    let png = dir.join("step.png");
    plot_category_timeline(&plot, &png).unwrap();
    assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
    let svg = dir.join("step.svg");
    plot_category_timeline(&plot, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    for label in [
        "parameter (max 2.00 GiB)",
        "optimizer state (max 4.00 GiB)",
        "activation (max 10.00 GiB)",
        "gradient (max 2.00 GiB)",
        "temporary (max 512.00 MiB)",
        "reserved (peak 19.00 GiB)",
        "capacity 23.00 GiB",
        "memory (GiB)",
        "backward",
        "optimizer",
    ] {
        assert!(text.contains(label), "SVG lacks {label:?}");
    }
    // categories that hold nothing stay out of the legend
    assert!(!text.contains("workspace"));
    assert!(!text.contains("out of memory"));

    let oom = CategoryTimelinePlot {
        oom_at: Some(5300.0),
        ..plot
    };
    let svg = dir.join("oom.svg");
    plot_category_timeline(&oom, &svg).unwrap();
    assert!(std::fs::read_to_string(&svg)
        .unwrap()
        .contains("out of memory"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_bar_per_configuration() {
    let bars: Vec<Bar> = (0..6u64)
        .map(|i| Bar {
            label: format!("amp-bf16 · checkpoint full · batch {}", 1 << i),
            allocated: (3 + 4 * i) * GIB,
            reserved: (4 + 4 * i) * GIB,
            device_used: (4 + 4 * i) * GIB + 512 * MIB,
            fits: i < 5,
        })
        .collect();
    let plot = BarPlot {
        title: "gpt2-medium: what if · NVIDIA GeForce RTX 4090",
        bars: &bars,
        capacity: Some(25_386_352_640),
        note: Some("6 of 6 configurations, lowest peak first"),
    };
    let dir = temp_dir("bars");
    let svg = dir.join("bars.svg");
    plot_bars(&plot, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    for label in [
        "batch 32",
        "OOM",
        "20.50 GiB",
        "23.64 GiB",
        "peak device used (+ CUDA context)",
        "out of memory (peaks up to the failure)",
        "memory (GiB)",
        "lowest peak first",
    ] {
        assert!(text.contains(label), "SVG lacks {label:?}");
    }
    // the image grows with the bars
    let many: Vec<Bar> = (0..40)
        .map(|i| Bar {
            label: format!("row {i}"),
            ..bars[0].clone()
        })
        .collect();
    let png = dir.join("many.png");
    plot_bars(
        &BarPlot {
            bars: &many,
            ..plot
        },
        &png,
    )
    .unwrap();
    let bytes = std::fs::read(&png).unwrap();
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert!(height > 1200, "{height}");
    assert!(matches!(
        plot_bars(&BarPlot { bars: &[], ..plot }, &dir.join("none.png")),
        Err(PlotError::NoSamples)
    ));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn peak_against_batch_size() {
    let points: Vec<SizePoint> = [1u64, 2, 4, 8, 16, 32, 24, 20, 22, 21]
        .iter()
        .map(|&b| SizePoint {
            size: b,
            device_used: 3 * GIB + b * GIB,
            fits: b <= 19,
        })
        .collect();
    let plot = SizeCurvePlot {
        title:
            "gpt2 (amp-bf16, seq 1024) on NVIDIA GeForce RTX 4090: peak memory against batch size",
        x_label: "batch size",
        points: &points,
        capacity: Some(23 * GIB),
        limit: Some(22 * GIB),
    };
    let dir = temp_dir("curve");
    let svg = dir.join("curve.svg");
    plot_size_curve(&plot, &svg).unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    for label in [
        "largest that fits: 16 (peak 19.00 GiB)",
        "first that does not: 20",
        "device memory 23.00 GiB",
        "limit 22.00 GiB",
        "batch size",
        "peak device memory (GiB)",
    ] {
        assert!(text.contains(label), "SVG lacks {label:?}");
    }
    let png = dir.join("curve.PNG");
    plot_size_curve(&plot, &png).unwrap();
    assert_eq!(&std::fs::read(&png).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
    let err = plot_size_curve(&plot, &dir.join("curve.jpg")).unwrap_err();
    assert!(matches!(err, PlotError::UnsupportedFormat { .. }), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
