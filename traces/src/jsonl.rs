//! The JSON Lines format: an optional header line, then one event object per line.
//!
//! ```text
//! {"format":"vramsim-trace","version":1,"meta":{"model":"gpt2"}}
//! {"op":"alloc","id":1,"size":4096,"stream":0,"category":"activation"}
//! {"op":"free","id":1}
//! ```
//!
//! [`JsonlReader`] streams: it holds one line at a time in a buffer it reuses, so reading a trace takes
//! memory for its longest line, not for its length. Blank lines are skipped. The first non-blank line is
//! the header when it is a JSON object without an `op` key; otherwise the trace has no header and that
//! line is its first event.

use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeSeed;

use crate::codec::{check_writable, DocProblem, DocSeed, EventSeed, Probe};
use crate::error::TraceError;
use crate::event::Event;
use crate::json::{io_err, is_space, json_io_err, located_error, strip_bom};
use crate::trace::{Meta, Trace, FORMAT_NAME, FORMAT_VERSION};

/// A streaming reader of a JSON Lines trace: an iterator over its events.
///
/// The header (if any) is read when the reader is made; [`JsonlReader::meta`] gives its `meta`.
/// Each call to `next` reads one line into a reused buffer and decodes it in place, allocating only
/// for what the event keeps (string ids, tags, phase names).
///
/// An error in one line is returned as that line's item and reading goes on with the next line, so a
/// caller may collect every error; after an I/O error the iterator ends. Event indices count every
/// event line, valid or not (the header and blank lines are not counted).
///
/// ```
/// use vramsim_traces::{JsonlReader, Event};
/// let text = "{\"format\":\"vramsim-trace\",\"version\":1,\"meta\":{\"model\":\"mlp\"}}\n\
///             {\"op\":\"alloc\",\"id\":1,\"size\":512}\n\n{\"op\":\"free\",\"id\":1}\n";
/// let reader = JsonlReader::new(text.as_bytes())?;
/// assert_eq!(reader.meta()["model"], "mlp");
/// let events: Vec<Event> = reader.collect::<Result<_, _>>()?;
/// assert_eq!(events.len(), 2);
/// # Ok::<(), vramsim_traces::TraceError>(())
/// ```
#[derive(Debug)]
pub struct JsonlReader<R> {
    reader: R,
    /// The current line, as read (its newline included).
    buf: Vec<u8>,
    meta: Meta,
    has_header: bool,
    /// 1-based number of the line in `buf` (0 before the first line).
    line: u64,
    /// Events handed out so far (the index of the next one).
    index: u64,
    /// `buf` holds the first event line, read while looking for the header.
    pending: bool,
    done: bool,
    path: Option<PathBuf>,
}

/// Lines longer than this give their buffer back once read, so one huge line does not pin memory.
const KEEP_CAPACITY: usize = 1 << 20;

impl<R: BufRead> JsonlReader<R> {
    /// Starts reading a JSON Lines trace: reads up to the first non-blank line, and the header if that
    /// line is one.
    ///
    /// Fails with [`TraceError::Empty`] when there is no non-blank line, and with
    /// [`TraceError::Header`] on a header that is not `{"format":"vramsim-trace","version":1,...}`.
    pub fn new(reader: R) -> Result<JsonlReader<R>, TraceError> {
        JsonlReader::open(reader, None)
    }

    /// As [`JsonlReader::new`], with `path` named in every error.
    pub fn with_path(reader: R, path: impl AsRef<Path>) -> Result<JsonlReader<R>, TraceError> {
        JsonlReader::open(reader, Some(path.as_ref().to_path_buf()))
    }

    fn open(reader: R, path: Option<PathBuf>) -> Result<JsonlReader<R>, TraceError> {
        let mut r = JsonlReader {
            reader,
            buf: Vec::with_capacity(256),
            meta: Meta::new(),
            has_header: false,
            line: 0,
            index: 0,
            pending: false,
            done: false,
            path,
        };
        if !r.next_line()? {
            return Err(TraceError::Empty { path: r.path });
        }
        let text = trim_newline(&r.buf);
        match serde_json::from_slice::<Probe>(text) {
            Ok(p) if p.is_object && !p.has_op => {
                let mut problem = None;
                let mut de = serde_json::Deserializer::from_slice(text);
                let doc = DocSeed {
                    slot: &mut problem,
                    events: false,
                }
                .deserialize(&mut de)
                .and_then(|doc| de.end().map(|()| doc))
                .map_err(|e| located_error(&e, problem, r.line, r.path.as_deref()))?;
                r.meta = doc.meta;
                r.has_header = true;
            }
            // An event, or text that is not JSON: the first item will say which.
            _ => r.pending = true,
        }
        Ok(r)
    }

    /// The header's `meta` (empty when there is no header).
    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Whether the trace began with a header line.
    pub fn has_header(&self) -> bool {
        self.has_header
    }

    /// 1-based number of the last line read.
    pub fn line(&self) -> u64 {
        self.line
    }

    /// The number of events handed out so far, valid or not: the index of the next one.
    pub fn events_read(&self) -> u64 {
        self.index
    }

    /// Reads the next non-blank line into `buf`; `false` at the end of the input.
    fn next_line(&mut self) -> Result<bool, TraceError> {
        loop {
            if self.buf.capacity() > KEEP_CAPACITY {
                self.buf = Vec::with_capacity(256);
            }
            self.buf.clear();
            let n = self
                .reader
                .read_until(b'\n', &mut self.buf)
                .map_err(|e| TraceError::io(self.path.as_deref(), e))?;
            if n == 0 {
                return Ok(false);
            }
            self.line += 1;
            if self.line == 1 && self.buf.starts_with(b"\xEF\xBB\xBF") {
                let rest = strip_bom(&self.buf).len();
                self.buf.drain(..self.buf.len() - rest);
            }
            if !self.buf.iter().all(|b| is_space(*b)) {
                return Ok(true);
            }
        }
    }

    /// Decodes the event line in `buf`.
    fn decode(&mut self) -> Result<Event, TraceError> {
        let index = self.index;
        self.index += 1;
        let mut problem = None;
        let mut de = serde_json::Deserializer::from_slice(trim_newline(&self.buf));
        EventSeed { slot: &mut problem }
            .deserialize(&mut de)
            .and_then(|event| de.end().map(|()| event))
            .map_err(|e| {
                let problem = problem.map(|problem| DocProblem::Event { index, problem });
                located_error(&e, problem, self.line, self.path.as_deref())
            })
    }
}

impl<R: BufRead> Iterator for JsonlReader<R> {
    type Item = Result<Event, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.pending {
            self.pending = false;
            return Some(self.decode());
        }
        if self.done {
            return None;
        }
        match self.next_line() {
            Ok(true) => Some(self.decode()),
            Ok(false) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// The line without its `\n` or `\r\n`.
fn trim_newline(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Reads a whole JSON Lines trace into memory (the first error ends it).
pub fn read_jsonl<R: BufRead>(reader: R) -> Result<Trace, TraceError> {
    let mut r = JsonlReader::new(reader)?;
    let events = r.by_ref().collect::<Result<Vec<_>, _>>()?;
    Ok(Trace {
        meta: r.meta,
        events,
    })
}

/// A writer of JSON Lines traces: the header line, then one line per event.
///
/// Output is buffered; call [`JsonlWriter::finish`] to flush it and see any error (dropping the writer
/// flushes too, but silently).
///
/// ```
/// use vramsim_traces::{JsonlWriter, Event, Meta};
/// let mut w = JsonlWriter::new(Vec::new(), &Meta::new())?;
/// w.write_event(&Event::EmptyCache)?;
/// let bytes = w.finish()?;
/// assert_eq!(bytes, b"{\"format\":\"vramsim-trace\",\"version\":1,\"meta\":{}}\n{\"op\":\"empty_cache\"}\n");
/// # Ok::<(), vramsim_traces::TraceError>(())
/// ```
#[derive(Debug)]
pub struct JsonlWriter<W: Write> {
    out: BufWriter<W>,
    index: u64,
}

impl<W: Write> JsonlWriter<W> {
    /// Starts a trace on `writer` with a header carrying `meta`.
    pub fn new(writer: W, meta: &Meta) -> Result<JsonlWriter<W>, TraceError> {
        let mut w = JsonlWriter::without_header(writer);
        write!(
            w.out,
            "{{\"format\":\"{FORMAT_NAME}\",\"version\":{FORMAT_VERSION},\"meta\":"
        )
        .map_err(io_err)?;
        serde_json::to_writer(&mut w.out, meta).map_err(json_io_err)?;
        w.out.write_all(b"}\n").map_err(io_err)?;
        Ok(w)
    }

    /// Starts a trace on `writer` with no header line (to append events to a trace, say).
    pub fn without_header(writer: W) -> JsonlWriter<W> {
        JsonlWriter {
            out: BufWriter::with_capacity(1 << 16, writer),
            index: 0,
        }
    }

    /// Writes one event as one line.
    ///
    /// Fails with [`TraceError::Unwritable`] on an event no reader would accept (a negative or
    /// non-finite `us`), writing nothing.
    pub fn write_event(&mut self, event: &Event) -> Result<(), TraceError> {
        let index = self.index;
        self.index += 1;
        check_writable(event).map_err(|problem| TraceError::Unwritable {
            path: None,
            index,
            problem,
        })?;
        serde_json::to_writer(&mut self.out, event).map_err(json_io_err)?;
        self.out.write_all(b"\n").map_err(io_err)
    }

    /// Flushes what is buffered and hands back the underlying writer.
    pub fn finish(self) -> Result<W, TraceError> {
        self.out.into_inner().map_err(|e| io_err(e.into_error()))
    }
}

/// Writes `trace` as JSON Lines: the header line, then one line per event.
///
/// Fails with [`TraceError::Unwritable`] on an event no reader would accept (a negative or non-finite
/// `us`), before writing anything.
pub fn write_jsonl<W: Write>(writer: W, trace: &Trace) -> Result<(), TraceError> {
    for (index, event) in trace.events.iter().enumerate() {
        check_writable(event).map_err(|problem| TraceError::Unwritable {
            path: None,
            index: index as u64,
            problem,
        })?;
    }
    let mut w = JsonlWriter::new(writer, &trace.meta)?;
    for event in &trace.events {
        w.write_event(event)?;
    }
    w.finish().map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_line_does_not_pin_its_buffer() {
        let mut text = String::from("{\"op\":\"phase\",\"name\":\"");
        text.push_str(&"x".repeat(3 << 20));
        text.push_str("\"}\n{\"op\":\"sync\"}\n{\"op\":\"sync\"}\n");
        let mut r = JsonlReader::new(text.as_bytes()).unwrap();
        assert!(matches!(r.next(), Some(Ok(Event::Phase { .. }))));
        assert!(matches!(r.next(), Some(Ok(Event::Sync { stream: None }))));
        assert!(r.buf.capacity() <= KEEP_CAPACITY);
        assert_eq!((r.events_read(), r.line()), (2, 2));
        assert!(r.next().is_some() && r.next().is_none() && r.next().is_none());
        assert_eq!(r.events_read(), 3);
    }

    #[test]
    fn trim_newline_strips_lf_and_crlf_only() {
        assert_eq!(trim_newline(b"{}\r\n"), b"{}");
        assert_eq!(trim_newline(b"{}\n"), b"{}");
        assert_eq!(trim_newline(b"{} "), b"{} ");
    }

    #[test]
    fn io_errors_end_the_iteration() {
        struct Failing(bool);
        impl std::io::Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if std::mem::replace(&mut self.0, true) {
                    return Err(std::io::Error::other("disk on fire"));
                }
                let line = b"{\"op\":\"sync\"}\n";
                buf[..line.len()].copy_from_slice(line);
                Ok(line.len())
            }
        }
        let r = JsonlReader::with_path(std::io::BufReader::new(Failing(false)), "x.jsonl").unwrap();
        let items: Vec<_> = r.collect();
        assert_eq!(items.len(), 2);
        assert!(items[0].is_ok());
        let e = items[1].as_ref().unwrap_err();
        assert_eq!(e.to_string(), "x.jsonl: I/O error: disk on fire");
    }
}
