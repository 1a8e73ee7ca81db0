//! Trace files: format detection on the way in, format by extension on the way out.
//!
//! Reading decides by content, never by name:
//!
//! 1. Input that starts with the gzip magic bytes `1f 8b` is decompressed (concatenated gzip members
//!    are read as one stream, as `zcat` does).
//! 2. The first non-blank line decides the format. If it starts with `{` and is either a complete JSON
//!    object with an `events` key, or the opening of an object that continues on later lines (a
//!    pretty-printed document), the input is a whole-document JSON trace. Anything else is JSON Lines.
//!
//! Writing decides by name: a file name ending in `.jsonl` or `.ndjson` (before an optional `.gz`) is
//! written as JSON Lines, anything else as a whole JSON document; a name ending in `.gz` is
//! gzip-compressed.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Cursor, Read, Write};
use std::path::{Path, PathBuf};

use flate2::read::MultiGzDecoder;
use flate2::write::GzEncoder;
use flate2::Compression;

use crate::codec::Probe;
use crate::error::TraceError;
use crate::event::Event;
use crate::json::{is_space, parse_json, strip_bom, write_json};
use crate::jsonl::{write_jsonl, JsonlReader};
use crate::trace::{Meta, Trace};

/// The two text formats of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// One JSON document, `{"format":"vramsim-trace","version":1,"meta":{...},"events":[...]}`.
    Json,
    /// An optional header line, then one event object per line.
    JsonLines,
}

impl Format {
    /// The format [`write_trace`] uses for `path`: JSON Lines for names ending in `.jsonl` or `.ndjson`
    /// (before an optional `.gz`), JSON otherwise.
    pub fn for_path(path: &Path) -> Format {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_ascii_lowercase())
            .unwrap_or_default();
        let name = name.strip_suffix(".gz").unwrap_or(&name);
        if name.ends_with(".jsonl") || name.ends_with(".ndjson") {
            Format::JsonLines
        } else {
            Format::Json
        }
    }
}

type Input = Box<dyn BufRead + Send>;

/// The events of a trace file, one at a time, whatever its format.
///
/// JSON Lines input streams (memory for one line, whatever the file's length); a whole-document JSON
/// trace is parsed when opened and its events handed out from memory. Errors are as
/// [`JsonlReader`]'s: an error in one line is that line's item, and reading goes on.
pub struct EventStream {
    inner: Inner,
    format: Format,
    compressed: bool,
    path: Option<PathBuf>,
}

enum Inner {
    Lines(JsonlReader<Input>),
    Loaded {
        meta: Meta,
        events: std::vec::IntoIter<Event>,
    },
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("format", &self.format)
            .field("compressed", &self.compressed)
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl EventStream {
    /// The header's `meta` (empty when there is no header or no `meta`).
    pub fn meta(&self) -> &Meta {
        match &self.inner {
            Inner::Lines(r) => r.meta(),
            Inner::Loaded { meta, .. } => meta,
        }
    }

    /// The format the input turned out to be.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Whether the input was gzip-compressed.
    pub fn is_compressed(&self) -> bool {
        self.compressed
    }

    /// Reads the remaining events into a [`Trace`] (the first error ends it).
    pub fn into_trace(self) -> Result<Trace, TraceError> {
        match self.inner {
            Inner::Loaded { meta, events } => Ok(Trace {
                meta,
                events: events.collect(),
            }),
            Inner::Lines(mut r) => {
                let (compressed, path) = (self.compressed, self.path);
                let events = r
                    .by_ref()
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| gzip_eof(e, compressed, path.as_deref()))?;
                Ok(Trace {
                    meta: r.meta().clone(),
                    events,
                })
            }
        }
    }
}

impl Iterator for EventStream {
    type Item = Result<Event, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        match &mut self.inner {
            Inner::Lines(r) => {
                let item = r.next()?;
                Some(item.map_err(|e| gzip_eof(e, self.compressed, self.path.as_deref())))
            }
            Inner::Loaded { events, .. } => events.next().map(Ok),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.inner {
            Inner::Lines(_) => (0, None),
            Inner::Loaded { events, .. } => events.size_hint(),
        }
    }
}

/// Opens a trace file of either format, gzip-compressed or not, for reading its events one at a time.
///
/// ```no_run
/// let mut events = vramsim_traces::open_events("step.jsonl.gz")?;
/// println!("model: {:?}", events.meta().get("model"));
/// for event in events {
///     let event = event?;
///     // ...
/// }
/// # Ok::<(), vramsim_traces::TraceError>(())
/// ```
pub fn open_events(path: impl AsRef<Path>) -> Result<EventStream, TraceError> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| TraceError::io(Some(path), e))?;
    open_input(Box::new(file), Some(path))
}

/// As [`open_events`], for a trace read from `reader` (standard input, say).
pub fn open_events_from<R: Read + Send + 'static>(reader: R) -> Result<EventStream, TraceError> {
    open_input(Box::new(reader), None)
}

/// Reads a whole trace file of either format, gzip-compressed or not.
pub fn read_trace(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
    open_events(path)?.into_trace()
}

/// As [`read_trace`], for a trace read from `reader`.
pub fn read_trace_from<R: Read + Send + 'static>(reader: R) -> Result<Trace, TraceError> {
    open_events_from(reader)?.into_trace()
}

/// Writes `trace` to `path` in the format its name asks for (see [`Format::for_path`]),
/// gzip-compressed when the name ends in `.gz`.
pub fn write_trace(path: impl AsRef<Path>, trace: &Trace) -> Result<(), TraceError> {
    let path = path.as_ref();
    let format = Format::for_path(path);
    let gzip = path
        .file_name()
        .is_some_and(|n| n.to_string_lossy().to_ascii_lowercase().ends_with(".gz"));
    let write = |w: &mut dyn Write| match format {
        Format::Json => write_json(w, trace),
        Format::JsonLines => write_jsonl(w, trace),
    };
    let mut file = File::create(path).map_err(|e| TraceError::io(Some(path), e))?;
    let written = if gzip {
        let mut encoder = GzEncoder::new(&mut file, Compression::default());
        write(&mut encoder).and_then(|()| {
            encoder
                .finish()
                .map(drop)
                .map_err(|e| TraceError::io(None, e))
        })
    } else {
        write(&mut file)
    };
    written.map_err(|e| e.with_path(path))
}

/// Size of the read buffers.
const BUFFER: usize = 1 << 16;

fn open_input(
    mut reader: Box<dyn Read + Send>,
    path: Option<&Path>,
) -> Result<EventStream, TraceError> {
    // Gzip is told by its magic bytes, never by the file name.
    let mut magic = [0u8; 2];
    let mut n = 0;
    while n < magic.len() {
        match reader.read(&mut magic[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TraceError::io(path, e)),
        }
    }
    let head = Cursor::new(magic).take(n as u64);
    let compressed = n == 2 && magic == [0x1f, 0x8b];
    let mut input: Input = if compressed {
        Box::new(BufReader::with_capacity(
            BUFFER,
            MultiGzDecoder::new(head.chain(reader)),
        ))
    } else {
        Box::new(BufReader::with_capacity(BUFFER, head.chain(reader)))
    };
    let fail = |e: io::Error| gzip_eof(TraceError::io(path, e), compressed, path);

    // Read up to the first non-blank line, keeping every byte read.
    let mut prefix = Vec::new();
    let first = loop {
        let start = prefix.len();
        if input.read_until(b'\n', &mut prefix).map_err(fail)? == 0 {
            return Err(TraceError::Empty {
                path: path.map(Path::to_path_buf),
            });
        }
        let line = &prefix[start..];
        let line = if start == 0 { strip_bom(line) } else { line };
        if !line.iter().all(|b| is_space(*b)) {
            break prefix.len() - line.len();
        }
    };
    let line = &prefix[first..];
    let opens_object = line.iter().find(|b| !is_space(**b)) == Some(&b'{');
    let is_document = opens_object
        && match serde_json::from_slice::<Probe>(line) {
            Ok(probe) => probe.has_events,
            Err(e) => e.is_eof(),
        };

    let path_buf = path.map(Path::to_path_buf);
    if is_document {
        input.read_to_end(&mut prefix).map_err(fail)?;
        let trace = parse_json(&prefix).map_err(|e| match path {
            Some(p) => e.with_path(p),
            None => e,
        })?;
        Ok(EventStream {
            inner: Inner::Loaded {
                meta: trace.meta,
                events: trace.events.into_iter(),
            },
            format: Format::Json,
            compressed,
            path: path_buf,
        })
    } else {
        let input: Input = Box::new(Cursor::new(prefix).chain(input));
        let reader = match path {
            Some(p) => JsonlReader::with_path(input, p),
            None => JsonlReader::new(input),
        }
        .map_err(|e| gzip_eof(e, compressed, path))?;
        Ok(EventStream {
            inner: Inner::Lines(reader),
            format: Format::JsonLines,
            compressed,
            path: path_buf,
        })
    }
}

/// A gzip stream that ends early shows up as an `UnexpectedEof` read error: say what it means.
fn gzip_eof(e: TraceError, compressed: bool, path: Option<&Path>) -> TraceError {
    match e {
        TraceError::Io { source, .. }
            if compressed && source.kind() == io::ErrorKind::UnexpectedEof =>
        {
            TraceError::TruncatedGzip {
                path: path.map(Path::to_path_buf),
            }
        }
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_and_errors_cross_threads() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send::<EventStream>();
        send::<JsonlReader<&[u8]>>();
        send_sync::<TraceError>();
        send_sync::<Trace>();
    }

    #[test]
    fn format_for_path() {
        for (name, format) in [
            ("a.jsonl", Format::JsonLines),
            ("a.JSONL", Format::JsonLines),
            ("a.ndjson.gz", Format::JsonLines),
            ("dir.jsonl/a.json", Format::Json),
            ("a.json.gz", Format::Json),
            ("a.gz", Format::Json),
            ("a", Format::Json),
            ("", Format::Json),
        ] {
            assert_eq!(Format::for_path(Path::new(name)), format, "{name}");
        }
    }
}
