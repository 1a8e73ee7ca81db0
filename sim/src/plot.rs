//! Memory-timeline plots: allocated and reserved bytes over time, against the device's capacity.
//!
//! [`plot_timeline`] draws one chart to a PNG or SVG file (chosen by the extension): reserved memory as a
//! filled area, allocated memory as a line in front of it, the capacity the allocator may use as a dashed
//! red line, the out-of-memory point as a red vertical marker, and named phases (forward, backward,
//! optimizer step, ...) as alternating light bands. The y axis is in GiB (MiB when everything is below
//! 1 GiB). Fonts are DejaVu Sans, embedded in the binary, so rendering needs no system font library.
//!
//! Long timelines are reduced before drawing to a few points per pixel column, keeping each column's
//! lowest and highest value so that neither peaks nor troughs disappear; [`downsample`] is the
//! peak-keeping reduction offered to callers that need fewer samples.

use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;
use thiserror::Error;

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
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let shown = path.display().to_string();
    if plot.samples.is_empty() {
        return Err(PlotError::NoSamples);
    }
    register_fonts();
    let fail = |message: String| PlotError::Draw {
        path: shown.clone(),
        message,
    };
    match ext.as_deref() {
        Some("png") => {
            let root = BitMapBackend::new(path, SIZE).into_drawing_area();
            draw(&root, plot).map_err(fail)?;
            root.present().map_err(|e| fail(e.to_string()))
        }
        Some("svg") => {
            let root = SVGBackend::new(path, SIZE).into_drawing_area();
            draw(&root, plot).map_err(fail)?;
            root.present().map_err(|e| fail(e.to_string()))
        }
        _ => Err(PlotError::UnsupportedFormat { path: shown }),
    }
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

    let mut x_min = samples.iter().map(|s| s.x).fold(f64::INFINITY, f64::min);
    let mut x_max = samples
        .iter()
        .map(|s| s.x)
        .fold(f64::NEG_INFINITY, f64::max);
    if let Some(oom) = plot.oom_at {
        x_min = x_min.min(oom);
        x_max = x_max.max(oom);
    }
    if x_max <= x_min {
        x_max = x_min + 1.0;
    }

    // Header: title and legend.
    let (header, body) = root.split_vertically(HEADER);
    let title_style = TextStyle::from((FONT, 22).into_font().style(FontStyle::Bold)).color(&INK);
    header
        .draw_text(plot.title, &title_style, (24, 12))
        .map_err(err)?;
    draw_legend(&header, plot, peak_allocated, peak_reserved).map_err(err)?;

    let mut chart = ChartBuilder::on(&body)
        .margin_left(16)
        .margin_right(32)
        .margin_top(8)
        .margin_bottom(12)
        .x_label_area_size(56)
        .y_label_area_size(72)
        .build_cartesian_2d(x_min..x_max, 0f64..y_top)
        .map_err(err)?;

    // Phase bands go first so the grid and the data are drawn over them.
    let bands: Vec<(f64, f64, &str)> = plot
        .phases
        .iter()
        .enumerate()
        .map(|(i, (start, name))| {
            let end = plot.phases.get(i + 1).map_or(x_max, |next| next.0);
            (start.max(x_min), end.min(x_max), name.as_str())
        })
        .filter(|(start, end, _)| end > start)
        .collect();
    chart
        .draw_series(bands.iter().enumerate().filter(|(i, _)| i % 2 == 0).map(
            |(_, (start, end, _))| Rectangle::new([(*start, 0.0), (*end, y_top)], BAND.filled()),
        ))
        .map_err(err)?;

    let label_style = TextStyle::from((FONT, 15).into_font()).color(&MUTED);
    let axis_style = TextStyle::from((FONT, 17).into_font()).color(&INK);
    chart
        .configure_mesh()
        .x_desc(plot.x_label)
        .y_desc(format!("memory ({})", unit.name))
        .x_labels(10)
        .y_labels(10)
        .x_label_formatter(&|v| compact_number(*v, x_max.abs().max(x_min.abs())))
        .y_label_formatter(&|v| trim_number(*v))
        .label_style(label_style.clone())
        .axis_desc_style(axis_style)
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(215, 215, 220))
        .axis_style(MUTED)
        .draw()
        .map_err(err)?;

    // Two points per bucket, about two buckets per pixel column.
    let (plot_left, plot_right) = {
        let range = chart.plotting_area().get_pixel_range();
        (range.0.start, range.0.end)
    };
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

    let small = TextStyle::from((FONT, 15).into_font());
    if let Some(capacity) = plot.capacity {
        let y = unit.of(capacity);
        chart
            .draw_series(DashedLineSeries::new(
                [(x_min, y), (x_max, y)],
                10,
                7,
                LIMIT.stroke_width(2),
            ))
            .map_err(err)?;
        // Labelled at the left end, where memory use is usually still low and no OOM marker stands.
        let (_, py) = chart.backend_coord(&(x_min, y));
        let text = format!("capacity {}", format_size(capacity));
        root.draw_text(
            &text,
            &small
                .clone()
                .color(&LIMIT)
                .pos(Pos::new(HPos::Left, VPos::Bottom)),
            (plot_left + 8, py - 5),
        )
        .map_err(err)?;
    }

    if let Some(oom) = plot.oom_at {
        chart
            .draw_series(LineSeries::new(
                [(oom, 0.0), (oom, y_top)],
                LIMIT.stroke_width(2),
            ))
            .map_err(err)?;
        // The marker sits on the allocated line where the failing request was made.
        let at = samples
            .iter()
            .min_by(|a, b| (a.x - oom).abs().total_cmp(&(b.x - oom).abs()))
            .map_or(0, |s| s.allocated);
        chart
            .draw_series(std::iter::once(Cross::new(
                (oom, unit.of(at)),
                8,
                LIMIT.stroke_width(3),
            )))
            .map_err(err)?;
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
        .map_err(err)?;
    }

    // Phase names at the top of their bands, shortened (or left out) to fit the band.
    let (_, top) = chart.backend_coord(&(x_min, y_top));
    let phase_style = TextStyle::from((FONT, 14).into_font()).color(&MUTED);
    for (start, end, name) in &bands {
        let (left, _) = chart.backend_coord(&(*start, y_top));
        let (right, _) = chart.backend_coord(&(*end, y_top));
        let room = (right - left - 8).max(0) as u32;
        if let Some(text) = fit_text(root, name, &phase_style, room) {
            root.draw_text(&text, &phase_style, (left + 4, top + 4))
                .map_err(err)?;
        }
    }
    Ok(())
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
