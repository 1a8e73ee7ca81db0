//! Memory-timeline plots: allocated and reserved bytes over time, against the device's capacity.
//!
//! [`plot_timeline`] draws one chart to a PNG or SVG file (chosen by the extension): reserved memory as a
//! filled area, allocated memory as a line in front of it, the capacity the allocator may use as a dashed
//! red line, the out-of-memory point as a red vertical marker, and named phases (forward, backward,
//! optimizer step, ...) as alternating light bands. The y axis is in GiB (MiB when everything is below
//! 1 GiB). Fonts are DejaVu Sans, embedded in the binary, so rendering needs no system font library.
//!
//! The what-if plots share that look: [`plot_category_timeline`] draws one step as stacked categories
//! (parameters at the bottom, temporaries on top) under the reserved line, with phase bands and the
//! capacity; [`plot_bars`] draws one horizontal bar per configuration (peak allocated inside peak reserved
//! inside peak device use, out-of-memory bars in red) against the device's memory; [`plot_size_curve`]
//! draws peak device use against batch size or sequence length, with the capacity, an optional headroom
//! limit, the largest size that fits and the first that does not.
//!
//! Long timelines are reduced before drawing to a few points per pixel column, keeping each column's
//! lowest and highest value so that neither peaks nor troughs disappear; [`downsample`] is the
//! peak-keeping reduction offered to callers that need fewer samples.

use std::path::Path;
use std::sync::OnceLock;

use plotters::chart::MeshStyle;
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;
use thiserror::Error;

use vramsim_traces::Category;

use crate::format::format_size;

/// One point of a memory timeline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TimelineSample {
    /// Position on the x axis: host time in ms, or the event index.
    pub x: f64,
    /// `allocated_bytes.all.current` at that point.
    pub allocated: u64,
    /// `reserved_bytes.all.current` at that point.
    pub reserved: u64,
}

/// Everything drawn in one timeline chart.
#[derive(Clone, Copy, Debug)]
pub struct TimelinePlot<'a> {
    /// Chart title (the trace and the allocator, typically).
    pub title: &'a str,
    /// Label of the x axis, e.g. `"event"` or `"time (ms)"`.
    pub x_label: &'a str,
    /// The samples, in increasing `x`.
    pub samples: &'a [TimelineSample],
    /// Bytes the allocator may reserve (device total minus context and other processes), drawn as a
    /// dashed red line.
    pub capacity: Option<u64>,
    /// The `x` of the allocation that ran out of memory, drawn as a red vertical marker.
    pub oom_at: Option<f64>,
    /// Phase starts and names, in increasing `x`; each phase lasts until the next one starts.
    pub phases: &'a [(f64, String)],
}

/// Why a plot could not be drawn.
#[derive(Debug, Error)]
pub enum PlotError {
    /// The file name does not end in a supported extension.
    #[error("cannot plot to {path:?}: unsupported file type; use a name ending in .png or .svg")]
    UnsupportedFormat {
        /// The path that was given.
        path: String,
    },
    /// There were no samples.
    #[error("nothing to plot: the timeline has no samples")]
    NoSamples,
    /// The drawing backend failed (for example the file could not be written).
    #[error("cannot draw {path:?}: {message}")]
    Draw {
        /// The output path.
        path: String,
        /// The backend's error.
        message: String,
    },
}

/// Width and height of the image in pixels.
const SIZE: (u32, u32) = (1280, 720);
/// Height of the strip above the chart holding the title and the legend.
const HEADER: u32 = 76;
/// Font family name the embedded fonts are registered under.
const FONT: &str = "sans-serif";

const RESERVED: RGBColor = RGBColor(70, 130, 180);
const ALLOCATED: RGBColor = RGBColor(230, 110, 20);
const LIMIT: RGBColor = RGBColor(205, 30, 30);
const BAND: RGBColor = RGBColor(232, 236, 244);
const INK: RGBColor = RGBColor(40, 40, 40);
const MUTED: RGBColor = RGBColor(90, 90, 100);

/// Draws `plot` to `path`: a PNG for `.png`, an SVG for `.svg` (case-insensitive).
pub fn plot_timeline(plot: &TimelinePlot, path: &Path) -> Result<(), PlotError> {
    if plot.samples.is_empty() {
        return Err(PlotError::NoSamples);
    }
    render(path, SIZE, |root| draw(root, plot), |root| draw(root, plot))
}

/// Reduces `samples` to at most `max_points`, keeping peaks: the samples are cut into `max_points`
/// consecutive buckets of (nearly) equal count, and each bucket becomes one sample holding the bucket's
/// largest `allocated` and largest `reserved`, placed at the `x` where `allocated` peaks.
///
/// Returns the samples unchanged when there are no more than `max_points`, and nothing when
/// `max_points` is 0.
pub fn downsample(samples: &[TimelineSample], max_points: usize) -> Vec<TimelineSample> {
    if samples.len() <= max_points {
        return samples.to_vec();
    }
    if max_points == 0 {
        return Vec::new();
    }
    buckets(samples.len(), max_points)
        .map(|range| {
            let bucket = &samples[range];
            let peak = bucket
                .iter()
                .max_by_key(|s| s.allocated)
                .expect("buckets are never empty");
            TimelineSample {
                x: peak.x,
                allocated: peak.allocated,
                reserved: bucket.iter().map(|s| s.reserved).max().unwrap_or(0),
            }
        })
        .collect()
}

/// `count` consecutive index ranges covering `0..len`, none empty (requires `0 < count <= len`).
fn buckets(len: usize, count: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..count).map(move |i| (i * len / count)..((i + 1) * len / count))
}

/// The points of one series reduced to each bucket's lowest and highest value, in `x` order, so that a
/// line through them covers the same vertical extent per pixel column as the full series.
fn envelope(
    samples: &[TimelineSample],
    value: impl Fn(&TimelineSample) -> u64,
    max_buckets: usize,
) -> Vec<(f64, u64)> {
    if samples.len() <= 2 * max_buckets {
        return samples.iter().map(|s| (s.x, value(s))).collect();
    }
    let mut points = Vec::with_capacity(2 * max_buckets);
    for range in buckets(samples.len(), max_buckets) {
        let bucket = &samples[range];
        let (mut lo, mut hi) = (0, 0);
        for (i, s) in bucket.iter().enumerate() {
            if value(s) < value(&bucket[lo]) {
                lo = i;
            }
            if value(s) > value(&bucket[hi]) {
                hi = i;
            }
        }
        let (first, second) = if lo <= hi { (lo, hi) } else { (hi, lo) };
        points.push((bucket[first].x, value(&bucket[first])));
        if second != first {
            points.push((bucket[second].x, value(&bucket[second])));
        }
    }
    points
}

/// Registers DejaVu Sans as the `sans-serif` family for plotters' text layout (once per process).
fn register_fonts() {
    static REGISTERED: OnceLock<()> = OnceLock::new();
    REGISTERED.get_or_init(|| {
        // The bytes are a valid TrueType font shipped by the `dejavu` crate, so registration cannot fail;
        // if it somehow did, text would be skipped rather than the plot failing.
        let _ = plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular());
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

/// The unit of the y axis: GiB, or MiB for timelines that stay below 1 GiB.
struct Unit {
    bytes: f64,
    name: &'static str,
}

impl Unit {
    fn for_max(max_bytes: u64) -> Unit {
        if max_bytes >= 1 << 30 {
            Unit {
                bytes: (1u64 << 30) as f64,
                name: "GiB",
            }
        } else {
            Unit {
                bytes: (1u64 << 20) as f64,
                name: "MiB",
            }
        }
    }

    fn of(&self, bytes: u64) -> f64 {
        bytes as f64 / self.bytes
    }
}

/// `12`, `12.5`, `0.25`: at most two decimals, without trailing zeros.
fn trim_number(v: f64) -> String {
    let s = format!("{v:.2}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

/// Axis labels for x, in one scale for the whole axis (chosen by its largest value `max`): `950`,
/// `12.5k`, `3.2M`.
fn compact_number(v: f64, max: f64) -> String {
    if v == 0.0 {
        "0".to_string()
    } else if max >= 1e7 {
        format!("{}M", trim_number(v / 1e6))
    } else if max >= 1e4 {
        format!("{}k", trim_number(v / 1e3))
    } else {
        trim_number(v)
    }
}

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    plot: &TimelinePlot,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;

    let samples = plot.samples;
    let peak_allocated = samples.iter().map(|s| s.allocated).max().unwrap_or(0);
    let peak_reserved = samples.iter().map(|s| s.reserved).max().unwrap_or(0);
    let top_bytes = peak_reserved
        .max(peak_allocated)
        .max(plot.capacity.unwrap_or(0))
        .max(1);
    let unit = Unit::for_max(top_bytes);
    // Head room above the highest line for the capacity label and the phase names.
    let y_top = unit.of(top_bytes) * 1.12;

    let (x_min, x_max) = x_range(samples.iter().map(|s| s.x), plot.oom_at);

    // Header: title and legend.
    let (header, body) = root.split_vertically(HEADER);
    let title_style = TextStyle::from((FONT, 22).into_font().style(FontStyle::Bold)).color(&INK);
    header
        .draw_text(plot.title, &title_style, (24, 12))
        .map_err(err)?;
    draw_legend(&header, plot, peak_allocated, peak_reserved).map_err(err)?;

    let mut chart = xy_chart(&body, 32, x_min..x_max, y_top).map_err(err)?;

    // Phase bands go first so the grid and the data are drawn over them.
    let bands = phase_bands(plot.phases, x_min, x_max);
    draw_phase_bands(&mut chart, &bands, y_top).map_err(err)?;
    draw_memory_mesh(&mut chart, plot.x_label, &unit, x_min, x_max).map_err(err)?;

    // Two points per bucket, about two buckets per pixel column.
    let (plot_left, plot_right) = pixel_x_range(&chart);
    let columns = usize::try_from(plot_right - plot_left).unwrap_or(1).max(1);
    let reserved = envelope(samples, |s| s.reserved, 2 * columns);
    let allocated = envelope(samples, |s| s.allocated, 2 * columns);

    chart
        .draw_series(
            AreaSeries::new(
                reserved.iter().map(|&(x, y)| (x, unit.of(y))),
                0.0,
                RESERVED.mix(0.22),
            )
            .border_style(RESERVED.stroke_width(2)),
        )
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(
            allocated.iter().map(|&(x, y)| (x, unit.of(y))),
            ALLOCATED.stroke_width(2),
        ))
        .map_err(err)?;

    if let Some(capacity) = plot.capacity {
        draw_capacity(root, &mut chart, &unit, capacity, x_min..x_max).map_err(err)?;
    }
    if let Some(oom) = plot.oom_at {
        // The marker sits on the allocated line where the failing request was made.
        let at = samples
            .iter()
            .min_by(|a, b| (a.x - oom).abs().total_cmp(&(b.x - oom).abs()))
            .map_or(0, |s| s.allocated);
        draw_oom_marker(root, &mut chart, oom, Some(unit.of(at)), x_min, y_top).map_err(err)?;
    }
    draw_phase_names(root, &chart, &bands, x_min, y_top).map_err(err)?;
    Ok(())
}

/// The chart's x and y coordinates: both in `f64`.
type XyChart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// The x range of a timeline: its samples' `xs`, widened to include the out-of-memory point, and at
/// least 1 wide.
fn x_range(xs: impl Iterator<Item = f64> + Clone, oom_at: Option<f64>) -> (f64, f64) {
    let mut x_min = xs.clone().fold(f64::INFINITY, f64::min);
    let mut x_max = xs.fold(f64::NEG_INFINITY, f64::max);
    if let Some(oom) = oom_at {
        x_min = x_min.min(oom);
        x_max = x_max.max(oom);
    }
    if x_max <= x_min {
        x_max = x_min + 1.0;
    }
    (x_min, x_max)
}

/// The chart of the timelines and the size curve, on `body`: `x` across, `0..y_top` up, with room left
/// and below for the axis labels.
fn xy_chart<'a, DB: DrawingBackend>(
    body: &'a DrawingArea<DB, Shift>,
    margin_right: u32,
    x: std::ops::Range<f64>,
    y_top: f64,
) -> Result<XyChart<'a, DB>, DrawingAreaErrorKind<DB::ErrorType>> {
    ChartBuilder::on(body)
        .margin_left(16)
        .margin_right(margin_right)
        .margin_top(8)
        .margin_bottom(12)
        .x_label_area_size(56)
        .y_label_area_size(72)
        .build_cartesian_2d(x, 0f64..y_top)
}

/// The look every chart's axes and grid share: muted labels, no light grid lines, a pale bold grid.
fn styled_mesh<'m, 'a, 'b, X: Ranged, Y: Ranged, DB: DrawingBackend>(
    mesh: &'m mut MeshStyle<'a, 'b, X, Y, DB>,
) -> &'m mut MeshStyle<'a, 'b, X, Y, DB> {
    mesh.label_style(TextStyle::from((FONT, 15).into_font()).color(&MUTED))
        .axis_desc_style(TextStyle::from((FONT, 17).into_font()).color(&INK))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(215, 215, 220))
        .axis_style(MUTED)
}

/// The axes of a memory timeline: `x_label` across in compact numbers, memory in `unit` up.
fn draw_memory_mesh<DB: DrawingBackend>(
    chart: &mut XyChart<DB>,
    x_label: &str,
    unit: &Unit,
    x_min: f64,
    x_max: f64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    styled_mesh(&mut chart.configure_mesh())
        .x_desc(x_label)
        .y_desc(format!("memory ({})", unit.name))
        .x_labels(10)
        .y_labels(10)
        .x_label_formatter(&|v| compact_number(*v, x_max.abs().max(x_min.abs())))
        .y_label_formatter(&|v| trim_number(*v))
        .draw()
}

/// Each phase's start, end and name, clipped to `x_min..x_max`; phases left empty are dropped.
fn phase_bands(phases: &[(f64, String)], x_min: f64, x_max: f64) -> Vec<(f64, f64, &str)> {
    phases
        .iter()
        .enumerate()
        .map(|(i, (start, name))| {
            let end = phases.get(i + 1).map_or(x_max, |next| next.0);
            (start.max(x_min), end.min(x_max), name.as_str())
        })
        .filter(|(start, end, _)| end > start)
        .collect()
}

/// Every other phase as a light band over the chart's full height.
fn draw_phase_bands<DB: DrawingBackend>(
    chart: &mut XyChart<DB>,
    bands: &[(f64, f64, &str)],
    y_top: f64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart.draw_series(bands.iter().enumerate().filter(|(i, _)| i % 2 == 0).map(
        |(_, (start, end, _))| Rectangle::new([(*start, 0.0), (*end, y_top)], BAND.filled()),
    ))?;
    Ok(())
}

/// Phase names at the top of their bands, shortened (or left out) to fit the band.
fn draw_phase_names<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &XyChart<DB>,
    bands: &[(f64, f64, &str)],
    x_min: f64,
    y_top: f64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let (_, top) = chart.backend_coord(&(x_min, y_top));
    let phase_style = TextStyle::from((FONT, 14).into_font()).color(&MUTED);
    for (start, end, name) in bands {
        let (left, _) = chart.backend_coord(&(*start, y_top));
        let (right, _) = chart.backend_coord(&(*end, y_top));
        let room = (right - left - 8).max(0) as u32;
        if let Some(text) = fit_text(root, name, &phase_style, room) {
            root.draw_text(&text, &phase_style, (left + 4, top + 4))?;
        }
    }
    Ok(())
}

/// The left and right pixel of the chart's plotting area.
fn pixel_x_range<DB: DrawingBackend>(chart: &XyChart<DB>) -> (i32, i32) {
    let range = chart.plotting_area().get_pixel_range();
    (range.0.start, range.0.end)
}

/// The capacity as a dashed red line across `x`, with its size written above the line's left end.
fn draw_capacity<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &mut XyChart<DB>,
    unit: &Unit,
    capacity: u64,
    x: std::ops::Range<f64>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let y = unit.of(capacity);
    chart.draw_series(DashedLineSeries::new(
        [(x.start, y), (x.end, y)],
        10,
        7,
        LIMIT.stroke_width(2),
    ))?;
    // Labelled at the left end, where memory use is usually still low and no OOM marker stands.
    let (plot_left, _) = pixel_x_range(chart);
    let (_, py) = chart.backend_coord(&(x.start, y));
    let text = format!("capacity {}", format_size(capacity));
    root.draw_text(
        &text,
        &TextStyle::from((FONT, 15).into_font())
            .color(&LIMIT)
            .pos(Pos::new(HPos::Left, VPos::Bottom)),
        (plot_left + 8, py - 5),
    )
}

/// The out-of-memory point as a red vertical line at `oom` (with a cross at `cross_y`, if given) and
/// an "out of memory" label beside it near the top.
fn draw_oom_marker<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &mut XyChart<DB>,
    oom: f64,
    cross_y: Option<f64>,
    x_min: f64,
    y_top: f64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart.draw_series(LineSeries::new(
        [(oom, 0.0), (oom, y_top)],
        LIMIT.stroke_width(2),
    ))?;
    if let Some(y) = cross_y {
        chart.draw_series(std::iter::once(Cross::new(
            (oom, y),
            8,
            LIMIT.stroke_width(3),
        )))?;
    }
    let (_, plot_right) = pixel_x_range(chart);
    let (px, _) = chart.backend_coord(&(oom, y_top));
    let (_, top) = chart.backend_coord(&(x_min, y_top));
    let bold = TextStyle::from((FONT, 16).into_font().style(FontStyle::Bold)).color(&LIMIT);
    // Put the label on whichever side of the line has room.
    let (hpos, dx) = if px + 90 < plot_right {
        (HPos::Left, 6)
    } else {
        (HPos::Right, -6)
    };
    root.draw_text(
        "out of memory",
        &bold.pos(Pos::new(hpos, VPos::Top)),
        (px + dx, top + 24),
    )
}

/// The legend under the title: one swatch and label per series, with the peaks.
fn draw_legend<DB: DrawingBackend>(
    header: &DrawingArea<DB, Shift>,
    plot: &TimelinePlot,
    peak_allocated: u64,
    peak_reserved: u64,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let style = TextStyle::from((FONT, 16).into_font())
        .color(&INK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    let y = 56;
    let mut x = 24;
    let mut entry = |swatch: &dyn Fn(i32) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>,
                     text: String|
     -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
        swatch(x)?;
        header.draw_text(&text, &style, (x + 34, y))?;
        let (w, _) = header.estimate_text_size(&text, &style)?;
        x += 34 + w as i32 + 28;
        Ok(())
    };
    entry(
        &|x| {
            header.draw(&Rectangle::new(
                [(x, y - 7), (x + 26, y + 7)],
                RESERVED.mix(0.22).filled(),
            ))?;
            header.draw(&PathElement::new(
                vec![(x, y - 7), (x + 26, y - 7)],
                RESERVED.stroke_width(2),
            ))
        },
        format!("reserved (peak {})", format_size(peak_reserved)),
    )?;
    entry(
        &|x| {
            header.draw(&PathElement::new(
                vec![(x, y), (x + 26, y)],
                ALLOCATED.stroke_width(3),
            ))
        },
        format!("allocated (peak {})", format_size(peak_allocated)),
    )?;
    if plot.capacity.is_some() {
        entry(
            &|x| {
                header.draw(&PathElement::new(
                    vec![(x, y), (x + 10, y)],
                    LIMIT.stroke_width(2),
                ))?;
                header.draw(&PathElement::new(
                    vec![(x + 16, y), (x + 26, y)],
                    LIMIT.stroke_width(2),
                ))
            },
            "capacity".to_string(),
        )?;
    }
    if plot.oom_at.is_some() {
        entry(
            &|x| {
                header.draw(&PathElement::new(
                    vec![(x + 13, y - 9), (x + 13, y + 9)],
                    LIMIT.stroke_width(2),
                ))
            },
            "out of memory".to_string(),
        )?;
    }
    Ok(())
}

/// `text`, or a prefix of it ending in `…`, that is at most `room` pixels wide; `None` if not even two
/// characters fit.
fn fit_text<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    text: &str,
    style: &TextStyle,
    room: u32,
) -> Option<String> {
    let width = |s: &str| area.estimate_text_size(s, style).map(|(w, _)| w).ok();
    if width(text)? <= room {
        return Some(text.to_string());
    }
    let chars: Vec<char> = text.chars().collect();
    (2..chars.len())
        .rev()
        .map(|n| format!("{}…", chars[..n].iter().collect::<String>()))
        .find(|candidate| width(candidate).is_some_and(|w| w <= room))
}

// ---------------------------------------------------------------------------------------------------
// What-if plots: one step by category, a bar per configuration, peak against batch size.
// ---------------------------------------------------------------------------------------------------

/// One point of a timeline broken down by category.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CategorySample {
    /// Position on the x axis (the event index, typically).
    pub x: f64,
    /// Live requested bytes by category, indexed as [`Category::ALL`].
    pub categories: [u64; Category::ALL.len()],
    /// `reserved_bytes.all.current` at that point.
    pub reserved: u64,
}

/// A memory timeline drawn as stacked categories (parameters at the bottom, temporaries on top), with
/// reserved memory as a line over them, phase bands, the capacity line and the out-of-memory point.
#[derive(Clone, Copy, Debug)]
pub struct CategoryTimelinePlot<'a> {
    /// Chart title (the model and its recipe, typically).
    pub title: &'a str,
    /// Label of the x axis.
    pub x_label: &'a str,
    /// The samples, in increasing `x`.
    pub samples: &'a [CategorySample],
    /// Bytes the allocator may reserve (device total minus context and other processes).
    pub capacity: Option<u64>,
    /// The `x` of the allocation that ran out of memory.
    pub oom_at: Option<f64>,
    /// Phase starts and names, in increasing `x`; each lasts until the next one starts.
    pub phases: &'a [(f64, String)],
}

/// One bar of a what-if chart: a configuration's peaks.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    /// The configuration, as shown left of the bar (`amp-bf16 · full · batch 16`).
    pub label: String,
    /// Peak allocated bytes.
    pub allocated: u64,
    /// Peak reserved bytes.
    pub reserved: u64,
    /// Peak device use (reserved plus CUDA context), the bar's length.
    pub device_used: u64,
    /// Whether the configuration fits; an out-of-memory bar shows the peaks before the failure.
    pub fits: bool,
}

/// A what-if bar chart: one horizontal bar per configuration, against the device's total memory.
#[derive(Clone, Copy, Debug)]
pub struct BarPlot<'a> {
    /// Chart title.
    pub title: &'a str,
    /// The bars, top to bottom.
    pub bars: &'a [Bar],
    /// The device's total memory, drawn as a dashed red line.
    pub capacity: Option<u64>,
    /// A line under the chart (what was left out, what the bars mean), if any.
    pub note: Option<&'a str>,
}

/// One size tried by a largest-batch search.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SizePoint {
    /// The batch size (or sequence length).
    pub size: u64,
    /// Peak device use (reserved plus CUDA context); for an out-of-memory size, the use at the failure.
    pub device_used: u64,
    /// Whether it fits.
    pub fits: bool,
}

/// Peak memory against batch size (or sequence length), with the capacity line, an optional headroom
/// line, the largest size that fits and the first that does not.
#[derive(Clone, Copy, Debug)]
pub struct SizeCurvePlot<'a> {
    /// Chart title.
    pub title: &'a str,
    /// Label of the x axis, e.g. `"batch size"`.
    pub x_label: &'a str,
    /// The sizes tried, in any order.
    pub points: &'a [SizePoint],
    /// The device's total memory (dashed red line).
    pub capacity: Option<u64>,
    /// The limit a fit must stay under when it is below the capacity (a safety margin), dotted.
    pub limit: Option<u64>,
}

/// Draws `plot` to `path` (PNG or SVG by extension).
pub fn plot_category_timeline(plot: &CategoryTimelinePlot, path: &Path) -> Result<(), PlotError> {
    if plot.samples.is_empty() {
        return Err(PlotError::NoSamples);
    }
    render(
        path,
        SIZE,
        |root| draw_categories(root, plot),
        |root| draw_categories(root, plot),
    )
}

/// Draws `plot` to `path` (PNG or SVG by extension); the image grows with the number of bars.
pub fn plot_bars(plot: &BarPlot, path: &Path) -> Result<(), PlotError> {
    if plot.bars.is_empty() {
        return Err(PlotError::NoSamples);
    }
    let height = (HEADER as usize + 110 + BAR_PITCH as usize * plot.bars.len()).max(420);
    let size = (SIZE.0, u32::try_from(height).unwrap_or(u32::MAX));
    render(
        path,
        size,
        |root| draw_bars(root, plot),
        |root| draw_bars(root, plot),
    )
}

/// Draws `plot` to `path` (PNG or SVG by extension).
pub fn plot_size_curve(plot: &SizeCurvePlot, path: &Path) -> Result<(), PlotError> {
    if plot.points.is_empty() {
        return Err(PlotError::NoSamples);
    }
    render(
        path,
        SIZE,
        |root| draw_size_curve(root, plot),
        |root| draw_size_curve(root, plot),
    )
}

/// Opens the backend the extension asks for, runs the matching drawing function and writes the file.
fn render(
    path: &Path,
    size: (u32, u32),
    png: impl FnOnce(&DrawingArea<BitMapBackend, Shift>) -> Result<(), String>,
    svg: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> Result<(), String>,
) -> Result<(), PlotError> {
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let shown = path.display().to_string();
    register_fonts();
    let fail = |message: String| PlotError::Draw {
        path: shown.clone(),
        message,
    };
    match ext.as_deref() {
        Some("png") => {
            let root = BitMapBackend::new(path, size).into_drawing_area();
            png(&root).map_err(fail)?;
            root.present().map_err(|e| fail(e.to_string()))
        }
        Some("svg") => {
            let root = SVGBackend::new(path, size).into_drawing_area();
            svg(&root).map_err(fail)?;
            root.present().map_err(|e| fail(e.to_string()))
        }
        _ => Err(PlotError::UnsupportedFormat { path: shown }),
    }
}

/// Stacking order, bottom to top: what lives all step first, what comes and goes last.
const STACK: [Category; Category::ALL.len()] = [
    Category::Parameter,
    Category::OptimizerState,
    Category::Gradient,
    Category::Input,
    Category::Activation,
    Category::AutogradDetail,
    Category::Temporary,
    Category::Workspace,
    Category::Communication,
    Category::Other,
];

/// A colour per category (Tableau 10, red left to the capacity and the out-of-memory marker).
fn category_color(category: Category) -> RGBColor {
    match category {
        Category::Parameter => RGBColor(78, 121, 167),
        Category::OptimizerState => RGBColor(242, 142, 43),
        Category::Gradient => RGBColor(118, 183, 178),
        Category::Input => RGBColor(255, 157, 167),
        Category::Activation => RGBColor(89, 161, 79),
        Category::AutogradDetail => RGBColor(156, 117, 95),
        Category::Temporary => RGBColor(237, 201, 72),
        Category::Workspace => RGBColor(176, 122, 161),
        Category::Communication => RGBColor(186, 176, 172),
        Category::Other => RGBColor(140, 140, 140),
    }
}

/// How a legend entry's swatch looks.
enum Swatch {
    /// A filled square.
    Fill(RGBColor),
    /// A solid line.
    Line(RGBColor),
    /// A dashed line.
    Dashed(RGBColor),
    /// A dotted line.
    Dotted(RGBColor),
    /// A vertical line (the out-of-memory marker).
    Vertical(RGBColor),
    /// A cross.
    Cross(RGBColor),
    /// A filled circle.
    Dot(RGBColor),
}

/// Draws the title and a legend that wraps onto a second row when the entries do not fit one.
fn draw_header<DB: DrawingBackend>(
    header: &DrawingArea<DB, Shift>,
    title: &str,
    entries: &[(Swatch, String)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let title_style = TextStyle::from((FONT, 22).into_font().style(FontStyle::Bold)).color(&INK);
    let room = header.dim_in_pixel().0.saturating_sub(48);
    let title = fit_text(header, title, &title_style, room).unwrap_or_default();
    header.draw_text(&title, &title_style, (24, 12))?;
    let style = TextStyle::from((FONT, 15).into_font())
        .color(&INK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    let width = header.dim_in_pixel().0 as i32;
    let (mut x, mut y) = (24, 52);
    for (swatch, text) in entries {
        let (w, _) = header.estimate_text_size(text, &style)?;
        let advance = 30 + w as i32 + 22;
        if x > 24 && x + advance > width - 16 {
            x = 24;
            y += 22;
        }
        match swatch {
            Swatch::Fill(c) => {
                header.draw(&Rectangle::new([(x, y - 7), (x + 22, y + 7)], c.filled()))?;
            }
            Swatch::Line(c) => {
                header.draw(&PathElement::new(
                    vec![(x, y), (x + 22, y)],
                    c.stroke_width(3),
                ))?;
            }
            Swatch::Dashed(c) => {
                for (a, b) in [(0, 8), (14, 22)] {
                    header.draw(&PathElement::new(
                        vec![(x + a, y), (x + b, y)],
                        c.stroke_width(2),
                    ))?;
                }
            }
            Swatch::Dotted(c) => {
                for a in (0..22).step_by(5) {
                    header.draw(&PathElement::new(
                        vec![(x + a, y), (x + a + 2, y)],
                        c.stroke_width(2),
                    ))?;
                }
            }
            Swatch::Vertical(c) => {
                header.draw(&PathElement::new(
                    vec![(x + 11, y - 9), (x + 11, y + 9)],
                    c.stroke_width(2),
                ))?;
            }
            Swatch::Cross(c) => {
                header.draw(&Cross::new((x + 11, y), 6, c.stroke_width(3)))?;
            }
            Swatch::Dot(c) => {
                header.draw(&Circle::new((x + 11, y), 5, c.filled()))?;
            }
        }
        header.draw_text(text, &style, (x + 30, y))?;
        x += advance;
    }
    Ok(())
}

/// Height of the header when its legend wraps onto a second row.
const TALL_HEADER: u32 = 98;

fn draw_categories<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    plot: &CategoryTimelinePlot,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let samples = plot.samples;
    let shown: Vec<Category> = STACK
        .iter()
        .copied()
        .filter(|c| samples.iter().any(|s| s.categories[c.index()] > 0))
        .collect();
    let total = |s: &CategorySample| -> u64 { s.categories.iter().sum() };
    let peak_total = samples.iter().map(total).max().unwrap_or(0);
    let peak_reserved = samples.iter().map(|s| s.reserved).max().unwrap_or(0);
    let top_bytes = peak_total
        .max(peak_reserved)
        .max(plot.capacity.unwrap_or(0))
        .max(1);
    let unit = Unit::for_max(top_bytes);
    let y_top = unit.of(top_bytes) * 1.12;
    let (x_min, x_max) = x_range(samples.iter().map(|s| s.x), plot.oom_at);

    let mut entries: Vec<(Swatch, String)> = shown
        .iter()
        .rev()
        .map(|c| {
            (
                Swatch::Fill(category_color(*c)),
                format!(
                    "{} (max {})",
                    c.name().replace('_', " "),
                    format_size(
                        samples
                            .iter()
                            .map(|s| s.categories[c.index()])
                            .max()
                            .unwrap_or(0)
                    )
                ),
            )
        })
        .collect();
    entries.push((
        Swatch::Line(INK),
        format!("reserved (peak {})", format_size(peak_reserved)),
    ));
    if plot.capacity.is_some() {
        entries.push((Swatch::Dashed(LIMIT), "capacity".to_string()));
    }
    if plot.oom_at.is_some() {
        entries.push((Swatch::Vertical(LIMIT), "out of memory".to_string()));
    }
    let (header, body) = root.split_vertically(TALL_HEADER);
    draw_header(&header, plot.title, &entries).map_err(err)?;

    let mut chart = xy_chart(&body, 32, x_min..x_max, y_top).map_err(err)?;
    let bands = phase_bands(plot.phases, x_min, x_max);
    draw_phase_bands(&mut chart, &bands, y_top).map_err(err)?;
    draw_memory_mesh(&mut chart, plot.x_label, &unit, x_min, x_max).map_err(err)?;

    // Stacked areas: each layer is drawn from zero to the top of its stack, highest stack first, so
    // that the next one down covers all but its own band.
    for depth in (0..shown.len()).rev() {
        let layers = &shown[..=depth];
        let color = category_color(shown[depth]);
        let points = samples.iter().map(|s| {
            let bytes: u64 = layers.iter().map(|c| s.categories[c.index()]).sum();
            (s.x, unit.of(bytes))
        });
        chart
            .draw_series(
                AreaSeries::new(points, 0.0, color.mix(0.85).filled())
                    .border_style(color.stroke_width(1)),
            )
            .map_err(err)?;
    }
    chart
        .draw_series(LineSeries::new(
            samples.iter().map(|s| (s.x, unit.of(s.reserved))),
            INK.stroke_width(2),
        ))
        .map_err(err)?;

    if let Some(capacity) = plot.capacity {
        draw_capacity(root, &mut chart, &unit, capacity, x_min..x_max).map_err(err)?;
    }
    if let Some(oom) = plot.oom_at {
        draw_oom_marker(root, &mut chart, oom, None, x_min, y_top).map_err(err)?;
    }
    draw_phase_names(root, &chart, &bands, x_min, y_top).map_err(err)?;
    Ok(())
}

/// Vertical pixels per bar of a what-if chart.
const BAR_PITCH: u32 = 30;

const FITS_LIGHT: RGBColor = RGBColor(198, 219, 239);
const FITS_MID: RGBColor = RGBColor(107, 174, 214);
const FITS_DARK: RGBColor = RGBColor(33, 113, 181);
const OOM_LIGHT: RGBColor = RGBColor(252, 210, 200);
const OOM_MID: RGBColor = RGBColor(245, 150, 130);
const OOM_DARK: RGBColor = RGBColor(200, 50, 40);

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    plot: &BarPlot,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let bars = plot.bars;
    let top_bytes = bars
        .iter()
        .map(|b| b.device_used.max(b.reserved).max(b.allocated))
        .chain(plot.capacity)
        .max()
        .unwrap_or(0)
        .max(1);
    let unit = Unit::for_max(top_bytes);
    // Room right of the longest bar for its figure.
    let x_top = unit.of(top_bytes) * 1.16;

    let mut entries = vec![
        (Swatch::Fill(FITS_DARK), "peak allocated".to_string()),
        (Swatch::Fill(FITS_MID), "peak reserved".to_string()),
        (
            Swatch::Fill(FITS_LIGHT),
            "peak device used (+ CUDA context)".to_string(),
        ),
    ];
    if bars.iter().any(|b| !b.fits) {
        entries.push((
            Swatch::Fill(OOM_MID),
            "out of memory (peaks up to the failure)".to_string(),
        ));
    }
    if plot.capacity.is_some() {
        entries.push((Swatch::Dashed(LIMIT), "device memory".to_string()));
    }
    let (header, rest) = root.split_vertically(TALL_HEADER);
    draw_header(&header, plot.title, &entries).map_err(err)?;
    let (body, footer) = rest.split_vertically(rest.dim_in_pixel().1.saturating_sub(28));
    if let Some(note) = plot.note {
        footer
            .draw_text(
                note,
                &TextStyle::from((FONT, 14).into_font()).color(&MUTED),
                (24, 4),
            )
            .map_err(err)?;
    }

    let label_style = TextStyle::from((FONT, 15).into_font()).color(&INK);
    let label_width = bars
        .iter()
        .map(|b| {
            body.estimate_text_size(&b.label, &label_style)
                .map_or(0, |(w, _)| w)
        })
        .max()
        .unwrap_or(0)
        .min(SIZE.0 / 2);
    let n = bars.len() as f64;
    let mut chart = ChartBuilder::on(&body)
        .margin_left(16)
        .margin_right(32)
        .margin_top(8)
        .margin_bottom(8)
        .x_label_area_size(52)
        .y_label_area_size(label_width + 16)
        .build_cartesian_2d(0f64..x_top, 0f64..n)
        .map_err(err)?;
    styled_mesh(&mut chart.configure_mesh())
        .x_desc(format!("memory ({})", unit.name))
        .x_labels(10)
        .x_label_formatter(&|v| trim_number(*v))
        .disable_y_mesh()
        .disable_y_axis()
        .draw()
        .map_err(err)?;

    // Bar i sits in the band [n-i-1, n-i): the first bar on top.
    let band = |i: usize| (n - i as f64 - 0.82, n - i as f64 - 0.18);
    for (i, bar) in bars.iter().enumerate() {
        let (lo, hi) = band(i);
        let (light, mid, dark) = if bar.fits {
            (FITS_LIGHT, FITS_MID, FITS_DARK)
        } else {
            (OOM_LIGHT, OOM_MID, OOM_DARK)
        };
        for (bytes, color, inset) in [
            (bar.device_used, light, 0.0),
            (bar.reserved, mid, 0.0),
            (bar.allocated, dark, 0.16),
        ] {
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(0.0, lo + inset), (unit.of(bytes), hi - inset)],
                    color.filled(),
                )))
                .map_err(err)?;
        }
        let (left, mid_y) = chart.backend_coord(&(0.0, (lo + hi) / 2.0));
        let text = fit_text(root, &bar.label, &label_style, label_width)
            .unwrap_or_else(|| bar.label.clone());
        root.draw_text(
            &text,
            &label_style.clone().pos(Pos::new(HPos::Right, VPos::Center)),
            (left - 8, mid_y),
        )
        .map_err(err)?;
        let (end, _) = chart.backend_coord(&(unit.of(bar.device_used), 0.0));
        let figure = if bar.fits {
            format_size(bar.device_used)
        } else {
            "OOM".to_string()
        };
        let figure_style = if bar.fits {
            TextStyle::from((FONT, 14).into_font()).color(&INK)
        } else {
            TextStyle::from((FONT, 14).into_font().style(FontStyle::Bold)).color(&OOM_DARK)
        };
        root.draw_text(
            &figure,
            &figure_style.pos(Pos::new(HPos::Left, VPos::Center)),
            (end + 6, mid_y),
        )
        .map_err(err)?;
    }
    if let Some(capacity) = plot.capacity {
        let x = unit.of(capacity);
        chart
            .draw_series(DashedLineSeries::new(
                [(x, 0.0), (x, n)],
                8,
                6,
                LIMIT.stroke_width(2),
            ))
            .map_err(err)?;
        let (px, top) = chart.backend_coord(&(x, n));
        root.draw_text(
            &format_size(capacity),
            &TextStyle::from((FONT, 14).into_font())
                .color(&LIMIT)
                .pos(Pos::new(HPos::Center, VPos::Bottom)),
            (px, top - 2),
        )
        .map_err(err)?;
    }
    Ok(())
}

fn draw_size_curve<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    plot: &SizeCurvePlot,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let mut points = plot.points.to_vec();
    points.sort_by_key(|p| p.size);
    let largest_fit = points.iter().filter(|p| p.fits).max_by_key(|p| p.size);
    let first_oom = points
        .iter()
        .filter(|p| !p.fits && largest_fit.is_none_or(|f| p.size > f.size))
        .min_by_key(|p| p.size);
    let top_bytes = points
        .iter()
        .map(|p| p.device_used)
        .chain(plot.capacity)
        .chain(plot.limit)
        .max()
        .unwrap_or(0)
        .max(1);
    let unit = Unit::for_max(top_bytes);
    let y_top = unit.of(top_bytes) * 1.15;
    let x_max = points.last().map_or(1, |p| p.size) as f64 * 1.05 + 0.5;
    let x_min = 0f64;

    let mut entries = vec![(Swatch::Dot(FITS_DARK), "peak device used, fits".to_string())];
    if points.iter().any(|p| !p.fits) {
        entries.push((
            Swatch::Cross(LIMIT),
            "does not fit (use when it failed)".to_string(),
        ));
    }
    if plot.capacity.is_some() {
        entries.push((Swatch::Dashed(LIMIT), "device memory".to_string()));
    }
    if plot.limit.is_some() {
        entries.push((Swatch::Dotted(OOM_DARK), "limit with headroom".to_string()));
    }
    let (header, body) = root.split_vertically(TALL_HEADER);
    draw_header(&header, plot.title, &entries).map_err(err)?;
    let mut chart = xy_chart(&body, 40, x_min..x_max, y_top).map_err(err)?;
    styled_mesh(&mut chart.configure_mesh())
        .x_desc(plot.x_label)
        .y_desc(format!("peak device memory ({})", unit.name))
        .x_labels(12)
        .y_labels(10)
        // sizes are whole numbers: no label between them
        .x_label_formatter(&|v| {
            if v.fract() == 0.0 {
                compact_number(*v, x_max)
            } else {
                String::new()
            }
        })
        .y_label_formatter(&|v| trim_number(*v))
        .draw()
        .map_err(err)?;
    let small = TextStyle::from((FONT, 15).into_font());
    let (plot_left, plot_right) = pixel_x_range(&chart);
    for (bytes, label, dotted) in plot
        .capacity
        .map(|c| (c, format!("device memory {}", format_size(c)), false))
        .into_iter()
        .chain(
            plot.limit
                .map(|l| (l, format!("limit {}", format_size(l)), true)),
        )
    {
        let y = unit.of(bytes);
        let (dash, gap, color) = if dotted {
            (3, 5, OOM_DARK)
        } else {
            (10, 7, LIMIT)
        };
        chart
            .draw_series(DashedLineSeries::new(
                [(x_min, y), (x_max, y)],
                dash,
                gap,
                color.stroke_width(2),
            ))
            .map_err(err)?;
        let (_, py) = chart.backend_coord(&(x_min, y));
        let (vpos, dy) = if dotted {
            (VPos::Top, 5)
        } else {
            (VPos::Bottom, -5)
        };
        root.draw_text(
            &label,
            &small.clone().color(&color).pos(Pos::new(HPos::Left, vpos)),
            (plot_left + 8, py + dy),
        )
        .map_err(err)?;
    }
    let fits: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.fits)
        .map(|p| (p.size as f64, unit.of(p.device_used)))
        .collect();
    chart
        .draw_series(LineSeries::new(
            fits.iter().copied(),
            FITS_DARK.stroke_width(2),
        ))
        .map_err(err)?;
    chart
        .draw_series(
            fits.iter()
                .map(|&(x, y)| Circle::new((x, y), 5, FITS_DARK.filled())),
        )
        .map_err(err)?;
    chart
        .draw_series(points.iter().filter(|p| !p.fits).map(|p| {
            Cross::new(
                (p.size as f64, unit.of(p.device_used)),
                7,
                LIMIT.stroke_width(3),
            )
        }))
        .map_err(err)?;
    // Rings around the two sizes that answer the question, and the answer in the lower right corner,
    // which a rising curve leaves empty.
    for (point, color) in [(largest_fit, FITS_DARK), (first_oom, LIMIT)] {
        if let Some(p) = point {
            chart
                .draw_series(std::iter::once(Circle::new(
                    (p.size as f64, unit.of(p.device_used)),
                    11,
                    color.stroke_width(2),
                )))
                .map_err(err)?;
        }
    }
    let mut lines: Vec<(String, RGBColor)> = Vec::new();
    if let Some(fit) = largest_fit {
        lines.push((
            format!(
                "largest that fits: {} (peak {})",
                fit.size,
                format_size(fit.device_used)
            ),
            FITS_DARK,
        ));
    }
    if let Some(oom) = first_oom {
        lines.push((format!("first that does not: {}", oom.size), LIMIT));
    }
    let (_, bottom) = chart.backend_coord(&(x_min, 0.0));
    let bold = TextStyle::from((FONT, 17).into_font().style(FontStyle::Bold));
    for (i, (text, color)) in lines.iter().rev().enumerate() {
        root.draw_text(
            text,
            &bold
                .clone()
                .color(color)
                .pos(Pos::new(HPos::Right, VPos::Bottom)),
            (plot_right - 12, bottom - 12 - 24 * i as i32),
        )
        .map_err(err)?;
    }
    Ok(())
}
