//! The whole-document JSON format: `{"format":"vramsim-trace","version":1,"meta":{...},"events":[...]}`.
//!
//! The document is read whole (it is one JSON value); traces too big for memory belong in JSON Lines
//! ([`crate::jsonl`]). Keys may come in any order. The writer puts the header keys first and one event
//! per line, so a written document diffs well and stays readable:
//!
//! ```text
//! {"format":"vramsim-trace","version":1,"meta":{"model":"gpt2"},"events":[
//! {"op":"alloc","id":1,"size":4096,"stream":0,"category":"activation"},
//! {"op":"free","id":1}
//! ]}
//! ```

use std::io::{self, BufWriter, Read, Write};
use std::path::Path;

use serde::de::DeserializeSeed;

use crate::codec::{bare_message, check_writable, DocProblem, DocSeed};
use crate::error::{Location, TraceError};
use crate::trace::{Trace, FORMAT_NAME, FORMAT_VERSION};

/// Parses a whole-document JSON trace held in memory.
///
/// Errors carry serde_json's line and column; an invalid event also carries its 0-based index in
/// `events`.
pub fn parse_json(bytes: &[u8]) -> Result<Trace, TraceError> {
    let bytes = strip_bom(bytes);
    if bytes.iter().all(|b| is_space(*b)) {
        return Err(TraceError::Empty { path: None });
    }
    let mut problem = None;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let doc = DocSeed {
        slot: &mut problem,
        events: true,
    }
    .deserialize(&mut de)
    .and_then(|doc| de.end().map(|()| doc));
    match doc {
        Ok(doc) => Ok(Trace {
            meta: doc.meta,
            events: doc.events.unwrap_or_default(),
        }),
        Err(e) => Err(located_error(&e, problem, e.line().max(1) as u64, None)),
    }
}

/// Reads a whole-document JSON trace from `reader` (all of it, then parses it).
pub fn read_json<R: Read>(mut reader: R) -> Result<Trace, TraceError> {
    let mut bytes = Vec::new();
    reader
        .read_to_end(&mut bytes)
        .map_err(|e| TraceError::io(None, e))?;
    parse_json(&bytes)
}

/// Writes `trace` as a whole-document JSON trace, one event per line.
///
/// The writer is buffered here and flushed before returning. Fails with
/// [`TraceError::Unwritable`] on an event no reader would accept (a negative or non-finite `us`),
/// before writing anything.
pub fn write_json<W: Write>(writer: W, trace: &Trace) -> Result<(), TraceError> {
    for (index, event) in trace.events.iter().enumerate() {
        check_writable(event).map_err(|problem| TraceError::Unwritable {
            path: None,
            index: index as u64,
            problem,
        })?;
    }
    let mut w = BufWriter::with_capacity(1 << 16, writer);
    write!(
        w,
        "{{\"format\":\"{FORMAT_NAME}\",\"version\":{FORMAT_VERSION},\"meta\":"
    )
    .map_err(io_err)?;
    serde_json::to_writer(&mut w, &trace.meta).map_err(json_io_err)?;
    w.write_all(b",\"events\":[").map_err(io_err)?;
    for (i, event) in trace.events.iter().enumerate() {
        w.write_all(if i == 0 { b"\n" } else { b",\n" })
            .map_err(io_err)?;
        serde_json::to_writer(&mut w, event).map_err(json_io_err)?;
    }
    w.write_all(b"\n]}\n").map_err(io_err)?;
    w.flush().map_err(io_err)
}

pub(crate) fn io_err(e: io::Error) -> TraceError {
    TraceError::io(None, e)
}

pub(crate) fn json_io_err(e: serde_json::Error) -> TraceError {
    TraceError::io(None, e.into())
}

/// A UTF-8 byte-order mark some editors put at the start of a file.
const BOM: &[u8] = b"\xEF\xBB\xBF";

pub(crate) fn strip_bom(bytes: &[u8]) -> &[u8] {
    bytes.strip_prefix(BOM).unwrap_or(bytes)
}

/// JSON's whitespace.
pub(crate) fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r' | b'\n')
}

/// Turns a serde_json error (and the problem a visitor recorded, if any) into a [`TraceError`] at
/// `line` of the file.
pub(crate) fn located_error(
    e: &serde_json::Error,
    problem: Option<DocProblem>,
    line: u64,
    path: Option<&Path>,
) -> TraceError {
    let at = Location {
        path: path.map(Path::to_path_buf),
        line,
        column: Some(e.column() as u64),
    };
    match problem {
        Some(DocProblem::Header(problem)) => TraceError::Header { at, problem },
        Some(DocProblem::Event { index, problem }) => TraceError::Event { at, index, problem },
        None if e.is_eof() => TraceError::Truncated {
            at,
            message: bare_message(e),
        },
        None if e.is_io() => TraceError::Io {
            path: path.map(Path::to_path_buf),
            source: io::Error::other(bare_message(e)),
        },
        None => TraceError::Syntax {
            at,
            message: bare_message(e),
        },
    }
}
