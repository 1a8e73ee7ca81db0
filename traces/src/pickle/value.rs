//! [`Value`]: the plain Python data a pickle can hold, and its accessors.

use std::fmt;
use std::sync::Arc;

/// One Python object of the plain-data subset that memory snapshots use.
///
/// Strings and containers sit behind [`Arc`], so a string or list that a pickle shares through its
/// memo (`BINGET` of an earlier `MEMOIZE`) is shared here too: reading a snapshot whose frames repeat
/// the same file names half a million times costs one allocation per distinct object, and cloning a
/// `Value` never copies data. `Arc` rather than `Rc` keeps `Value` (and everything holding one)
/// `Send + Sync`.
///
/// Integers that fit in `i64` are always [`Value::Int`]; only larger ones are [`Value::BigInt`].
/// `bytearray` objects (protocol 5) read as [`Value::Bytes`]; Python 2 `str` objects
/// (`BINSTRING`) read as [`Value::Str`].
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// Python `None`.
    None,
    /// Python `bool`.
    Bool(bool),
    /// Python `int` that fits in 64 signed bits.
    Int(i64),
    /// Python `int` outside the `i64` range: its minimal two's-complement little-endian bytes, exactly
    /// as the `LONG1`/`LONG4` opcodes store them (so `-1` would be `[0xff]`, `2**63` is
    /// `[0, 0, 0, 0, 0, 0, 0, 0x80, 0]`).
    BigInt(Arc<[u8]>),
    /// Python `float`.
    Float(f64),
    /// Python `str`.
    Str(Arc<str>),
    /// Python `bytes` (and `bytearray`).
    Bytes(Arc<[u8]>),
    /// Python `list`.
    List(Arc<Vec<Value>>),
    /// Python `tuple`.
    Tuple(Arc<Vec<Value>>),
    /// Python `dict`, in insertion order. Keys are unique: a pickle that sets a key twice keeps the
    /// last value at the first key's position, as Python does (keys compare by variant and value, so
    /// unlike Python `1`, `1.0` and `True` are three different keys).
    Dict(Arc<Vec<(Value, Value)>>),
}

impl Value {
    /// A `str` value.
    pub fn str(s: &str) -> Value {
        Value::Str(Arc::from(s))
    }

    /// A `list` value.
    pub fn list(items: Vec<Value>) -> Value {
        Value::List(Arc::new(items))
    }

    /// A `tuple` value.
    pub fn tuple(items: Vec<Value>) -> Value {
        Value::Tuple(Arc::new(items))
    }

    /// A `dict` value from `(key, value)` pairs, which the caller keeps unique.
    pub fn dict(entries: Vec<(Value, Value)>) -> Value {
        Value::Dict(Arc::new(entries))
    }

    /// The Python name of this value's type (`"int"`, `"str"`, `"NoneType"`, ...), for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "NoneType",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
        }
    }

    /// The integer, if this is an [`Value::Int`] (not a `bool`, not a `BigInt`).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(n) => Some(*n),
            _ => None,
        }
    }

    /// The boolean, if this is a [`Value::Bool`].
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The float, if this is a [`Value::Float`] (integers are not converted).
    pub fn as_float(&self) -> Option<f64> {
        match self {
            Value::Float(x) => Some(*x),
            _ => None,
        }
    }

    /// The string, if this is a [`Value::Str`].
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The bytes, if this is a [`Value::Bytes`].
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }

    /// The items, if this is a [`Value::List`].
    pub fn as_list(&self) -> Option<&[Value]> {
        match self {
            Value::List(items) => Some(items),
            _ => None,
        }
    }

    /// The items, if this is a [`Value::Tuple`].
    pub fn as_tuple(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(items) => Some(items),
            _ => None,
        }
    }

    /// The items of a [`Value::List`] or a [`Value::Tuple`].
    pub fn as_sequence(&self) -> Option<&[Value]> {
        match self {
            Value::List(items) | Value::Tuple(items) => Some(items),
            _ => None,
        }
    }

    /// The entries, if this is a [`Value::Dict`].
    pub fn as_dict(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(entries) => Some(entries),
            _ => None,
        }
    }

    /// The value under the string key `key`, if this is a dict that has it (a linear scan: snapshot
    /// dicts have a dozen keys).
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.as_dict()?
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

impl From<i64> for Value {
    fn from(n: i64) -> Self {
        Value::Int(n)
    }
}

impl From<u64> for Value {
    /// Values above `i64::MAX` become a [`Value::BigInt`].
    fn from(n: u64) -> Self {
        match i64::try_from(n) {
            Ok(n) => Value::Int(n),
            Err(_) => {
                let mut bytes = n.to_le_bytes().to_vec();
                bytes.push(0);
                Value::BigInt(bytes.into())
            }
        }
    }
}

impl From<f64> for Value {
    fn from(x: f64) -> Self {
        Value::Float(x)
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::str(s)
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s.into())
    }
}

impl From<Vec<Value>> for Value {
    /// A `list`.
    fn from(items: Vec<Value>) -> Self {
        Value::list(items)
    }
}

impl fmt::Display for Value {
    /// Python-like `repr` text (`{'a': [1, 2.5, None]}`), for messages and debugging.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn seq(f: &mut fmt::Formatter<'_>, items: &[Value]) -> fmt::Result {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{item}")?;
            }
            Ok(())
        }
        match self {
            Value::None => f.write_str("None"),
            Value::Bool(true) => f.write_str("True"),
            Value::Bool(false) => f.write_str("False"),
            Value::Int(n) => write!(f, "{n}"),
            Value::BigInt(bytes) => {
                f.write_str("0x")?;
                for b in bytes.iter().rev() {
                    write!(f, "{b:02x}")?;
                }
                f.write_str(" (two's complement)")
            }
            Value::Float(x) => write!(f, "{x:?}"),
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Bytes(b) => write!(f, "b{:?}", String::from_utf8_lossy(b)),
            Value::List(items) => {
                f.write_str("[")?;
                seq(f, items)?;
                f.write_str("]")
            }
            Value::Tuple(items) => {
                f.write_str("(")?;
                seq(f, items)?;
                if items.len() == 1 {
                    f.write_str(",")?;
                }
                f.write_str(")")
            }
            Value::Dict(entries) => {
                f.write_str("{")?;
                for (i, (k, v)) in entries.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{k}: {v}")?;
                }
                f.write_str("}")
            }
        }
    }
}
