//! A small, dependency-free pickle reader and writer for the plain data in PyTorch memory snapshots.
//!
//! `torch.cuda.memory._dump_snapshot()` writes a protocol-4 pickle of nested dicts, lists, tuples,
//! strings, ints, floats and bools. Real snapshots share objects through the pickle *memo* heavily
//! (every frame dict and file name is written once and then referenced with `BINGET`/`LONG_BINGET`,
//! millions of times in a big file), which is why this is not `serde-pickle` 1.2 (it rejects memo
//! references to containers with `Recursive`).
//!
//! ```
//! use vramsim_traces::pickle::{self, Value};
//! let v = Value::dict(vec![(Value::str("size"), Value::Int(512))]);
//! let bytes = pickle::to_vec(&v);
//! assert_eq!(pickle::from_slice(&bytes).unwrap(), v);
//! ```
//!
//! # How the reader works
//! A stack machine over the opcodes, as in CPython's `pickle.py`: `MARK` fences the stack (pops never
//! reach below the last mark), the memo maps integers to objects. Lists, dicts and tuples that still
//! hold containers are built in an arena while reading, because Python mutates a list *after*
//! memoizing it (`EMPTY_LIST MEMOIZE MARK ... APPENDS`) and every memo reference must see the final
//! contents; after `STOP` the arena is frozen into [`Value`]s, each arena node exactly once, so a
//! container referenced a thousand times becomes one `Arc` shared a thousand times.
//!
//! Supported: every opcode of protocols 0 to 5 that builds plain data. Python objects
//! (`GLOBAL`, `STACK_GLOBAL`, `REDUCE`, `BUILD`, `NEWOBJ`, `INST`, `OBJ`, extensions, persistent
//! ids), sets, out-of-band buffers and the protocol-0 `STRING` opcode are rejected with a
//! [`PickleError`] naming the opcode and its byte offset; none occurs in the 17 real snapshots this
//! crate is tested on (whose opcodes are `PROTO FRAME STOP MARK EMPTY_DICT EMPTY_LIST SETITEMS APPENDS
//! APPEND TUPLE2 MEMOIZE BINGET LONG_BINGET BININT BININT1 BININT2 LONG1 BINFLOAT SHORT_BINUNICODE
//! BINUNICODE NEWTRUE NEWFALSE`). The reader never panics, whatever the input: malformed input gives
//! an error with the byte offset of the opcode at fault. Self-containing structures (a list appended
//! to itself) and nesting deeper than [`MAX_DEPTH`] containers are rejected. Strings that are not
//! valid UTF-8 (Python writes lone surrogates with `surrogatepass`) are decoded lossily, with U+FFFD.
//!
//! # How the writer works
//! [`to_vec`] writes protocol 4 without framing and memoizes every distinct string and every
//! container shared between several places (same `Arc`), so a snapshot read and written back keeps
//! its sharing. It uses only opcodes that `torch/utils/viz/MemoryViz.js`'s own unpickler reads
//! (`PROTO 4`, `MEMOIZE`, `BINGET`/`LONG_BINGET`, `EMPTY_*`, `MARK`, `APPEND(S)`, `SETITEM(S)`,
//! `TUPLE*`, `BININT*`, `LONG1`, `BINFLOAT`, `(SHORT_)BINUNICODE`, `NONE`, `NEWTRUE`/`NEWFALSE`)
//! unless the value holds bytes (`SHORT_BINBYTES`/`BINBYTES`/`BINBYTES8`), strings over 4 GiB
//! (`BINUNICODE8`) or ints over 255 bytes (`LONG4`).

mod read;
mod value;
mod write;

pub use read::{from_reader, from_slice, MAX_DEPTH};
pub use value::Value;
pub use write::{to_vec, to_writer};

/// A pickle that could not be read: what was wrong, and the byte offset (in the uncompressed
/// stream) of the opcode at fault.
#[derive(Debug, thiserror::Error)]
#[error("pickle error at byte {offset}: {kind}")]
pub struct PickleError {
    /// Byte offset of the opcode being executed when the error was found (for errors found after
    /// `STOP`, such as [`PickleErrorKind::Recursive`], the offset where the container was created).
    pub offset: u64,
    /// What was wrong.
    pub kind: PickleErrorKind,
}

/// The ways a pickle can be unreadable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PickleErrorKind {
    /// The input has no bytes at all.
    #[error("empty input: not a pickle")]
    Empty,
    /// The first byte is no pickle opcode, so this is some other kind of file.
    #[error("not a pickle: the first byte 0x{0:02x} is no pickle opcode")]
    NotAPickle(u8),
    /// `PROTO` names a protocol newer than 5.
    #[error("unsupported pickle protocol {0} (this reader knows protocols 0 to 5)")]
    UnsupportedProtocol(u8),
    /// A byte that is no opcode of any pickle protocol.
    #[error("unknown opcode 0x{0:02x}")]
    UnknownOpcode(u8),
    /// A valid opcode outside the plain-data subset (Python objects, sets, buffers).
    #[error("opcode {name} is not supported: {why}")]
    UnsupportedOpcode {
        /// The opcode's name in `pickletools`.
        name: &'static str,
        /// Why, and what it was about to build where known.
        why: String,
    },
    /// The stream ends inside an opcode's argument.
    #[error("truncated stream: {opcode} needs {needed} more bytes, {available} left")]
    Truncated {
        /// The opcode whose argument is cut off.
        opcode: &'static str,
        /// Bytes the argument needs.
        needed: u64,
        /// Bytes left in the stream.
        available: u64,
    },
    /// The stream ends inside a text (protocol 0) argument, before its newline.
    #[error("truncated stream: {opcode} needs a newline-terminated argument")]
    MissingNewline {
        /// The opcode whose argument is cut off.
        opcode: &'static str,
    },
    /// The stream ends without a `STOP` opcode.
    #[error("truncated stream: no STOP opcode")]
    MissingStop,
    /// An opcode needs more values than the stack holds above the last `MARK`.
    #[error("stack underflow: {opcode} needs {needed} value(s) above the last MARK")]
    StackUnderflow {
        /// The opcode.
        opcode: &'static str,
        /// Values it needs.
        needed: usize,
    },
    /// An opcode that consumes a `MARK` found none.
    #[error("{opcode} without a MARK")]
    MarkNotFound {
        /// The opcode.
        opcode: &'static str,
    },
    /// A memo reference (`BINGET` and friends) to a key never stored.
    #[error("memo key {0} not found")]
    MemoKeyNotFound(u64),
    /// An opcode found the wrong kind of object on the stack (`APPENDS` onto a dict, say).
    #[error("{opcode} expects a {expected} on the stack, found {found}")]
    WrongType {
        /// The opcode.
        opcode: &'static str,
        /// The Python type it needs.
        expected: &'static str,
        /// The Python type it found.
        found: &'static str,
    },
    /// `SETITEMS` or `DICT` with an odd number of values after the mark.
    #[error("{opcode}: {count} values do not make key/value pairs")]
    OddItems {
        /// The opcode.
        opcode: &'static str,
        /// Values found after the mark.
        count: usize,
    },
    /// An argument that does not parse (a negative length, a bad number in a text opcode).
    #[error("{opcode}: bad argument {text:?}: {why}")]
    BadArgument {
        /// The opcode.
        opcode: &'static str,
        /// The argument, as text.
        text: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Containers nested deeper than [`MAX_DEPTH`].
    #[error("containers nested deeper than {0}")]
    TooDeep(usize),
    /// A container that contains itself (Python allows it; [`Value`] cannot hold it).
    #[error("a container contains itself; recursive structures are not supported")]
    Recursive,
    /// Reading the input failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}
