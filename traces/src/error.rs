//! [`TraceError`]: everything that can go wrong reading or writing a trace, said so a person can fix it.
//!
//! Every error says *where* (file, line, column, event index) and *what would be valid*. Errors in the
//! text of a trace come in three layers:
//!
//! - [`TraceError::Syntax`] and [`TraceError::Truncated`]: the bytes are not JSON (serde_json's own
//!   message, with the line and column in the file).
//! - [`TraceError::Header`]: the JSON is fine but the header (`format`, `version`, `meta`) is not.
//! - [`TraceError::Event`]: the JSON is fine but one event is not ([`EventProblem`] says how), with its
//!   0-based index among the trace's events.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use crate::event::{Category, OPS};
use crate::trace::{FORMAT_NAME, FORMAT_VERSION};

/// Where in a trace file something went wrong.
///
/// Lines are 1-based. Columns are serde_json's: the number of bytes of the line read when the problem
/// was found, so the column is that of the last byte read (the end of the offending value, the closing
/// `}` of an event that lacks a field, the last byte of a truncated line). For JSON Lines `line` is the
/// line of the file and `column` the column within that line; for a whole-document JSON trace both come
/// from serde_json.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The file, when the trace was read from a named file.
    pub path: Option<PathBuf>,
    /// 1-based line number in the file.
    pub line: u64,
    /// 1-based column within the line, where known.
    pub column: Option<u64>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `path:line:column`, the form editors and terminals turn into links.
        match (&self.path, self.column) {
            (Some(p), Some(c)) => write!(f, "{}:{}:{}", p.display(), self.line, c),
            (Some(p), None) => write!(f, "{}:{}", p.display(), self.line),
            (None, Some(c)) => write!(f, "line {}, column {}", self.line, c),
            (None, None) => write!(f, "line {}", self.line),
        }
    }
}

/// Any failure to read or write a trace.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The operating system refused a read or a write (a missing file, a full disk, corrupt gzip data).
    #[error("{}: {source}", io_context(.path))]
    Io {
        /// The file, when known.
        path: Option<PathBuf>,
        /// What the operating system (or the gzip decoder) said.
        #[source]
        source: io::Error,
    },
    /// The input holds nothing but whitespace.
    #[error("{}the trace is empty: no header and no events (a trace with no events still needs its header line `{{\"format\":\"{FORMAT_NAME}\",\"version\":{FORMAT_VERSION}}}`)", prefix(.path))]
    Empty {
        /// The file, when known.
        path: Option<PathBuf>,
    },
    /// The text is not valid JSON.
    #[error("{at}: JSON syntax error: {message}")]
    Syntax {
        /// Where serde_json stopped.
        at: Location,
        /// serde_json's description, without its own position.
        message: String,
    },
    /// The JSON text ends in the middle of a value: the file (or, in JSON Lines, the line) was cut short.
    #[error("{at}: the JSON ends early ({message}): the trace looks truncated")]
    Truncated {
        /// Where the text ended.
        at: Location,
        /// serde_json's description, without its own position.
        message: String,
    },
    /// A gzip-compressed trace ends before its compressed stream does.
    #[error("{}the gzip stream ends early: the file looks truncated", prefix(.path))]
    TruncatedGzip {
        /// The file, when known.
        path: Option<PathBuf>,
    },
    /// The header object is not a vramsim trace header this reader understands.
    #[error("{at}: header: {problem}")]
    Header {
        /// Where the problem was found.
        at: Location,
        /// What is wrong.
        problem: HeaderProblem,
    },
    /// One event is valid JSON but not a valid event.
    #[error("{at}: event {index}: {problem}")]
    Event {
        /// Where the problem was found.
        at: Location,
        /// 0-based index of the event among the trace's events (header and blank lines not counted).
        index: u64,
        /// What is wrong.
        problem: EventProblem,
    },
    /// A writer was handed an event no reader would accept (a negative or non-finite `us`).
    #[error("{}event {index} cannot be written: {problem}", prefix(.path))]
    Unwritable {
        /// The file, when known.
        path: Option<PathBuf>,
        /// 0-based index of the event among those written.
        index: u64,
        /// What is wrong.
        problem: EventProblem,
    },
}

fn io_context(path: &Option<PathBuf>) -> String {
    match path {
        Some(p) => format!("{}: I/O error", p.display()),
        None => "I/O error".to_owned(),
    }
}

fn prefix(path: &Option<PathBuf>) -> String {
    match path {
        Some(p) => format!("{}: ", p.display()),
        None => String::new(),
    }
}

impl TraceError {
    /// The same error, naming `path` as the file it happened in (where it does not name one already).
    pub fn with_path(mut self, path: impl AsRef<Path>) -> TraceError {
        let slot = match &mut self {
            TraceError::Io { path, .. }
            | TraceError::Empty { path }
            | TraceError::TruncatedGzip { path }
            | TraceError::Unwritable { path, .. } => path,
            TraceError::Syntax { at, .. }
            | TraceError::Truncated { at, .. }
            | TraceError::Header { at, .. }
            | TraceError::Event { at, .. } => &mut at.path,
        };
        if slot.is_none() {
            *slot = Some(path.as_ref().to_path_buf());
        }
        self
    }

    /// The file the error happened in, where known.
    pub fn path(&self) -> Option<&Path> {
        match self {
            TraceError::Io { path, .. }
            | TraceError::Empty { path }
            | TraceError::TruncatedGzip { path }
            | TraceError::Unwritable { path, .. } => path.as_deref(),
            TraceError::Syntax { at, .. }
            | TraceError::Truncated { at, .. }
            | TraceError::Header { at, .. }
            | TraceError::Event { at, .. } => at.path.as_deref(),
        }
    }

    /// Where in the file the error is, for errors about the text of a trace.
    pub fn location(&self) -> Option<&Location> {
        match self {
            TraceError::Syntax { at, .. }
            | TraceError::Truncated { at, .. }
            | TraceError::Header { at, .. }
            | TraceError::Event { at, .. } => Some(at),
            _ => None,
        }
    }

    /// 1-based line of the error in the file, where known.
    pub fn line(&self) -> Option<u64> {
        self.location().map(|at| at.line)
    }

    /// 1-based column of the error in its line, where known.
    pub fn column(&self) -> Option<u64> {
        self.location().and_then(|at| at.column)
    }

    /// 0-based index of the offending event, for errors about one event.
    pub fn event_index(&self) -> Option<u64> {
        match self {
            TraceError::Event { index, .. } | TraceError::Unwritable { index, .. } => Some(*index),
            _ => None,
        }
    }

    /// What is wrong with the offending event, for errors about one event.
    pub fn event_problem(&self) -> Option<&EventProblem> {
        match self {
            TraceError::Event { problem, .. } | TraceError::Unwritable { problem, .. } => {
                Some(problem)
            }
            _ => None,
        }
    }

    pub(crate) fn io(path: Option<&Path>, source: io::Error) -> TraceError {
        TraceError::Io {
            path: path.map(Path::to_path_buf),
            source,
        }
    }
}

/// What is wrong with a trace header (`{"format":"vramsim-trace","version":1,"meta":{...}}`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderProblem {
    /// The header has no `format` key.
    #[error("no `format` key: a vramsim trace header is `{{\"format\":\"{FORMAT_NAME}\",\"version\":{FORMAT_VERSION},\"meta\":{{...}}}}` (if this line is meant to be an event, it lacks its `op`)")]
    MissingFormat,
    /// `format` is not `"vramsim-trace"`.
    #[error("`format` is {found}, expected \"{FORMAT_NAME}\"")]
    WrongFormat {
        /// The value found, as JSON-ish text.
        found: String,
    },
    /// The header has no `version` key.
    #[error("no `version` key: this reader reads version {FORMAT_VERSION}")]
    MissingVersion,
    /// `version` is not a version this reader knows.
    #[error("unsupported version {found}: this reader reads version {FORMAT_VERSION}")]
    UnsupportedVersion {
        /// The value found, as JSON-ish text.
        found: String,
    },
    /// `meta` is not a JSON object.
    #[error("`meta` must be a JSON object, got {found}")]
    MetaNotObject {
        /// A description of the value found.
        found: String,
    },
    /// A whole-document JSON trace lacks its `events` array.
    #[error("no `events` key: a whole-document JSON trace holds its events in `\"events\":[...]`")]
    MissingEvents,
    /// `events` is not an array.
    #[error("`events` must be an array of event objects, got {found}")]
    EventsNotArray {
        /// A description of the value found.
        found: String,
    },
    /// A JSON Lines header has an `events` key: the input is a whole-document JSON trace.
    #[error("a JSON Lines header has no `events`: this is a whole-document JSON trace (read it with `read_json` or `read_trace`)")]
    EventsInJsonLines,
    /// The header, or the document's top level, has a key this reader does not know.
    #[error("unknown key `{key}`: a trace header has the keys format, version, meta (and events in a whole-document JSON trace){}", unknown_header_key_hint(.key))]
    UnknownKey {
        /// The key.
        key: String,
    },
    /// A key appears twice.
    #[error("key `{key}` appears twice")]
    DuplicateKey {
        /// The key.
        key: &'static str,
    },
    /// The header (or the document) is not a JSON object.
    #[error("a trace header must be a JSON object, got {found}")]
    NotAnObject {
        /// A description of the value found.
        found: String,
    },
}

fn unknown_header_key_hint(key: &str) -> &'static str {
    if key == "op" {
        " (this looks like an event: is this a JSON Lines trace whose first line is cut short?)"
    } else {
        ""
    }
}

/// What is wrong with one event of a trace.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum EventProblem {
    /// The event is not a JSON object.
    #[error("an event must be a JSON object like {{\"op\":\"free\",\"id\":1}}, got {found}")]
    NotAnObject {
        /// A description of the value found.
        found: String,
    },
    /// The event has no `op`.
    #[error("missing `op`: expected {}", expected("op"))]
    MissingOp,
    /// `op` names no operation this reader knows.
    #[error("unknown op {op:?}: valid ops are {}", OPS.join(", "))]
    UnknownOp {
        /// The op found.
        op: String,
    },
    /// An event lacks a field its op requires.
    #[error("missing `{field}` for op `{op}`: expected {} (op `{op}` takes {})", expected(.field), op_keys(.op))]
    MissingField {
        /// The missing field.
        field: &'static str,
        /// The op of the event.
        op: &'static str,
    },
    /// A field holds a value of the wrong JSON type (or a number out of its range).
    #[error("`{field}` must be {}, got {found}", expected(.field))]
    WrongType {
        /// The field.
        field: &'static str,
        /// A description of the value found.
        found: String,
    },
    /// `id` is neither a non-negative integer nor a string.
    #[error("`id` must be a non-negative integer or a string, got {found}")]
    BadId {
        /// A description of the value found.
        found: String,
    },
    /// `size` is negative.
    #[error("`size` is negative ({found}): sizes are byte counts, 0 or more")]
    SizeNegative {
        /// The value found.
        found: String,
    },
    /// `size` is not an integer (a fraction, or a number written with a decimal point or exponent).
    #[error("`size` is not an integer ({found}): sizes are whole bytes, written as an integer")]
    SizeNotInteger {
        /// The value found.
        found: String,
    },
    /// `size` does not fit in 64 bits.
    #[error("`size` {found} is larger than the largest 64-bit size, {max} bytes (sizes up to that are accepted: 2^60 bytes or more replays as PyTorch's \"more than 1EB\" out-of-memory error)", max = u64::MAX)]
    SizeTooLarge {
        /// The value found.
        found: String,
    },
    /// `category` names no category this reader knows.
    #[error(
        "unknown category {category:?}: valid categories are {}",
        category_names()
    )]
    UnknownCategory {
        /// The category found.
        category: String,
    },
    /// `us` is negative.
    #[error("`us` is negative ({us:?}): a duration is 0 or more microseconds")]
    DurationNegative {
        /// The value found.
        us: f64,
    },
    /// `us` is NaN or infinite (only possible for events built in code: JSON has no such numbers).
    #[error("`us` is not finite ({us:?}): a duration is a finite number of microseconds")]
    DurationNotFinite {
        /// The value found.
        us: f64,
    },
    /// A key the event's op does not take, or no op takes.
    #[error("{}", unknown_key_message(.key, *.op))]
    UnknownKey {
        /// The key.
        key: String,
        /// The event's op, where the event has a valid one.
        op: Option<&'static str>,
    },
    /// A key appears twice in one event.
    #[error("key `{key}` appears twice")]
    DuplicateKey {
        /// The key.
        key: &'static str,
    },
    /// `pool` names no pool.
    #[error("unknown pool {pool:?}: a segment's pool is \"small\" or \"large\"")]
    UnknownPool {
        /// The pool found.
        pool: String,
    },
    /// A `segment` of 0 bytes.
    #[error("`size` is 0: a segment holds at least one byte")]
    EmptySegment,
    /// A `segment` whose last byte would lie past the end of the 64-bit address space.
    #[error("the segment at `addr` {addr} of {size} bytes runs past the end of the 64-bit address space")]
    SegmentPastAddressSpace {
        /// The segment's address.
        addr: u64,
        /// Its size.
        size: u64,
    },
    /// `base` on a segment that is not expandable, or above its `addr`.
    #[error("{}", bad_base(*.base, *.addr))]
    BadBase {
        /// The `base` given.
        base: u64,
        /// The segment's `addr` (`None`: the segment is not expandable).
        addr: Option<u64>,
    },
    /// One block of a `segment`'s `blocks` is not valid.
    #[error("blocks[{index}]: {problem}")]
    Block {
        /// 0-based index of the block in `blocks`.
        index: usize,
        /// What is wrong with it.
        problem: BlockProblem,
    },
}

fn bad_base(base: u64, addr: Option<u64>) -> String {
    match addr {
        None => format!("`base` ({base}) is for expandable segments only: a reservation's start (add \"expandable\":true, or leave `base` out)"),
        Some(addr) => format!("`base` ({base}) is above `addr` ({addr}): the reservation starts at or below the ranges mapped in it"),
    }
}

/// What is wrong with one block of a `segment` event (`{"id":1,"offset":0,"size":512,"requested":500}`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockProblem {
    /// The block is not a JSON object.
    #[error(
        "a block must be a JSON object like {{\"id\":1,\"offset\":0,\"size\":512}}, got {found}"
    )]
    NotAnObject {
        /// A description of the value found.
        found: String,
    },
    /// The block lacks a key it requires.
    #[error("missing `{field}`: expected {} ({BLOCK_KEYS_TEXT})", expected(.field))]
    MissingField {
        /// The missing key.
        field: &'static str,
    },
    /// A key no block takes.
    #[error("unknown key `{key}` ({BLOCK_KEYS_TEXT})")]
    UnknownKey {
        /// The key.
        key: String,
    },
    /// A key appears twice in the block.
    #[error("key `{key}` appears twice")]
    DuplicateKey {
        /// The key.
        key: &'static str,
    },
    /// A value of the wrong JSON type (or a negative or fractional number where a byte count belongs).
    #[error("`{field}` must be {}, got {found}", expected(.field))]
    WrongType {
        /// The key.
        field: &'static str,
        /// A description of the value found.
        found: String,
    },
    /// `category` names no category.
    #[error(
        "unknown category {category:?}: valid categories are {}",
        category_names()
    )]
    UnknownCategory {
        /// The category found.
        category: String,
    },
    /// A block of 0 bytes.
    #[error("`size` is 0: a block holds at least one byte")]
    Empty,
    /// `requested` exceeds `size` (a block is never smaller than the request it serves).
    #[error("`requested` ({requested}) is larger than `size` ({size}): a block holds at least the bytes requested")]
    RequestedTooLarge {
        /// The requested bytes.
        requested: u64,
        /// The block's size.
        size: u64,
    },
    /// The block reaches past the end of its segment.
    #[error(
        "the block at offset {offset} of {size} bytes ends past the segment's {segment_size} bytes"
    )]
    OutOfSegment {
        /// The block's offset.
        offset: u64,
        /// The block's size.
        size: u64,
        /// The segment's size.
        segment_size: u64,
    },
    /// The block starts before the previous block ends.
    #[error("the block at offset {offset} starts before the previous block ends (offset {previous_end}): blocks are listed in address order and do not overlap")]
    Overlaps {
        /// The block's offset.
        offset: u64,
        /// Where the previous block ends.
        previous_end: u64,
    },
}

/// The keys a block of a `segment` takes, for error messages.
pub(crate) const BLOCK_KEYS_TEXT: &str =
    "a block takes id, offset, size, and optionally requested (default: size), category (default \"other\") and tag";

/// Every key some event takes.
pub(crate) const EVENT_KEYS: [&str; 13] = [
    "op",
    "id",
    "size",
    "stream",
    "category",
    "tag",
    "us",
    "name",
    "addr",
    "pool",
    "expandable",
    "blocks",
    "base",
];

fn unknown_key_message(key: &str, op: Option<&'static str>) -> String {
    let mut s = match op {
        Some(op) if EVENT_KEYS.contains(&key) => {
            format!(
                "key `{key}` does not go with op `{op}` (op `{op}` takes {})",
                op_keys(op)
            )
        }
        Some(op) => format!("unknown key `{key}` (op `{op}` takes {})", op_keys(op)),
        None => format!(
            "unknown key `{key}`: valid keys are {}",
            EVENT_KEYS.join(", ")
        ),
    };
    if matches!(key, "format" | "version" | "meta" | "events") {
        s.push_str("; a header is only allowed as the first line of a JSON Lines trace");
    }
    s
}

/// The keys an event of `op` takes, for error messages.
pub(crate) fn op_keys(op: &str) -> &'static str {
    match op {
        "alloc" => {
            "op, id, size, and optionally stream (default 0), category (default \"other\") and tag"
        }
        "free" => "op and id",
        "record_stream" => "op, id and stream",
        "empty_cache" => "op only",
        "compute" => "op, us, and optionally stream (default 0)",
        "sync" => "op, and optionally stream (default: every stream)",
        "phase" => "op and name",
        "segment" => "op, addr, size, pool, and optionally stream (default 0), expandable (default false), blocks (default: none) and base (expandable only)",
        _ => "unknown keys",
    }
}

/// What a field must hold, for error messages.
pub(crate) fn expected(field: &str) -> String {
    match field {
        "op" => format!("one of {}", OPS.join(", ")),
        "id" => "a non-negative integer or a string".to_owned(),
        "size" => "a non-negative integer number of bytes".to_owned(),
        "stream" => "a non-negative integer stream id".to_owned(),
        "category" => format!("one of {}", category_names()),
        "tag" => "a string (or null for none)".to_owned(),
        "us" => "a finite, non-negative number of microseconds".to_owned(),
        "name" => "a string".to_owned(),
        "addr" => "a non-negative integer device address".to_owned(),
        "pool" => "\"small\" or \"large\"".to_owned(),
        "expandable" => "true or false".to_owned(),
        "blocks" => {
            "an array of block objects like {\"id\":1,\"offset\":0,\"size\":512}".to_owned()
        }
        "base" => "a non-negative integer device address".to_owned(),
        "offset" => "a non-negative integer number of bytes from the segment's start".to_owned(),
        "requested" => "a non-negative integer number of bytes".to_owned(),
        _ => "a valid value".to_owned(),
    }
}

fn category_names() -> String {
    Category::ALL.map(Category::name).join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_print_like_compiler_positions() {
        let mut at = Location {
            path: None,
            line: 3,
            column: Some(7),
        };
        assert_eq!(at.to_string(), "line 3, column 7");
        at.column = None;
        assert_eq!(at.to_string(), "line 3");
        at.path = Some("t.jsonl".into());
        assert_eq!(at.to_string(), "t.jsonl:3");
        at.column = Some(7);
        assert_eq!(at.to_string(), "t.jsonl:3:7");
    }

    #[test]
    fn with_path_fills_in_but_never_replaces() {
        let e = TraceError::Empty { path: None }.with_path("a.json");
        assert_eq!(e.path(), Some(Path::new("a.json")));
        let e = e.with_path("b.json");
        assert_eq!(e.path(), Some(Path::new("a.json")));
        assert_eq!(
            e.to_string(),
            "a.json: the trace is empty: no header and no events (a trace with no events still needs its header line `{\"format\":\"vramsim-trace\",\"version\":1}`)"
        );
    }

    #[test]
    fn every_field_says_what_is_valid() {
        for field in EVENT_KEYS {
            assert_ne!(expected(field), "a valid value", "{field}");
        }
        for op in OPS {
            assert_ne!(op_keys(op), "unknown keys", "{op}");
        }
    }
}
