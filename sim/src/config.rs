//! `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF`: the allocator settings and their parser (fact sheet
//! §12).
//!
//! [`AllocatorConfig::parse`] reads a settings string exactly as PyTorch 2.15.0 does when the variable is
//! set at start-up, and [`AllocatorConfig::apply`] as `torch.cuda.memory._set_allocator_settings` does at
//! run time. Accepted strings, the values they produce and the text of every rejection follow PyTorch's
//! code; the rejections were checked against the released binary (fixture
//! `sim/tests/data/pytorch_text/config_parse_torch-2.15.0.json`, produced by `gen_config_errors.py`
//! beside it).
//!
//! # How PyTorch parses (2.10 and later; 2.15.0 is the reference)
//!
//! 1. A tokenizer (`c10::CachingAllocator::ConfigTokenizer`) makes `,` `:` `[` `]` tokens of their own,
//!    drops whitespace and glues everything else into words: `"max_split_size_mb 40"` is one word
//!    `max_split_size_mb40` (§12.2).
//! 2. The device-generic `AcceleratorAllocatorConfig` walks the tokens twice: first only for
//!    `large_segment_size_mb` (so that the other minimums can depend on it), then for its own keys. It
//!    skips the CUDA keys and rejects every key that neither part knows.
//! 3. The CUDA part (`CUDAAllocatorConfig`, a hook) walks the same tokens again for the CUDA keys.
//!
//! The walk never checks separators: PyTorch calls `checkToken(i, ":")` and ignores its result, so
//! `max_split_size_mb,40` means `max_split_size_mb:40` and `a:1:b:2` reads as `a:1,b:2`. A missing token
//! is an internal assert ("Index out of bounds in ConfigTokenizer"). Numbers go through C++'s `stoull` and
//! `stod`, with their quirks: `40MB` is 40, `-1` wraps to 2^64 − 1, garbage raises a `ValueError` whose
//! whole text is `stoull`.
//!
//! # Versions
//!
//! - 2.9 and earlier used an older parser with other messages ("Unrecognized CachingAllocator option: foo",
//!   "max_split_size_mb too small, must be > 20", "Error parsing CachingAllocator settings, expected :"
//!   for a missing separator). That parser is not modelled.
//! - 2.10 introduced the tokenizer parser modelled here (`ValueError`s, "must be >= 20", `>` filling from
//!   the entry after the last listed one).
//! - By 2.15 `large_segment_size_mb`, `pinned_max_round_threshold_mb`, `pinned_max_cached_size_mb`,
//!   `pinned_free_catch_all`, `throw_on_cudamalloc_oom` and `expandable_segments_reserve(_by_class)` were
//!   added; 2.10 rejects them as unrecognized keys.

use std::fmt;

use crate::rounding::{LARGE_BUFFER, MIN_LARGE_ALLOC};

/// One mebibyte: every `_mb` value is in MiB (`kMB = 1024 * 1024`).
const MB: u64 = 1 << 20;
/// `roundup_power2_divisions` has one entry per power-of-two interval from 1 MiB to 64 GiB (§12.4).
const ROUNDUP_INTERVALS: usize = 16;
/// `CUDAAllocatorConfig::pinned_max_register_threads()`.
const PINNED_MAX_REGISTER_THREADS: u64 = 128;

/// Keys parsed by the device-generic `AcceleratorAllocatorConfig` (2.15.0).
const ACCELERATOR_KEYS: [&str; 9] = [
    "large_segment_size_mb",
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "pinned_use_background_threads",
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
];

/// Keys the CUDA hook registers and parses (2.15.0; the `hip` spellings are accepted on CUDA too).
const CUDA_KEYS: [&str; 13] = [
    "backend",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "graph_capture_record_stream_reuse",
    "per_process_memory_fraction",
    "pinned_free_catch_all",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
];

/// The warning PyTorch prints when `backend:cudaMallocAsync` comes with a CUDA key that only the native
/// allocator reads (text of 2.15.0, missing space and all).
pub const MALLOC_ASYNC_IGNORES_WARNING: &str = "backend:cudaMallocAsync ignores max_split_size_mb,\
roundup_power2_divisions, and garbage_collect_threshold.";

/// Which allocator backend the settings string selects (`backend:native|cudaMallocAsync`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// The caching allocator.
    #[default]
    Native,
    /// CUDA's stream-ordered allocator.
    CudaMallocAsync,
}

impl Backend {
    /// The name PyTorch uses (`get()->name()`): `native` or `cudaMallocAsync`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Native => "native",
            Backend::CudaMallocAsync => "cudaMallocAsync",
        }
    }
}

/// Every setting of the native caching allocator, with PyTorch's defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct AllocatorConfig {
    /// The settings string as given (`allocator_settings["PYTORCH_CUDA_ALLOC_CONF"]`).
    pub settings: String,
    /// `backend`.
    pub backend: Backend,
    /// `max_split_size_mb` in bytes; `u64::MAX` (SIZE_MAX) when unset.
    pub max_split_size: u64,
    /// `max_non_split_rounding_mb` in bytes (default: `large_segment_size`, 20 MiB).
    pub max_non_split_rounding_size: u64,
    /// `roundup_power2_divisions`: 16 entries, entry k for sizes in [2^(20+k), 2^(21+k)) (§12.4).
    pub roundup_power2_divisions: [u64; 16],
    /// `garbage_collection_threshold` (0 = off).
    pub garbage_collection_threshold: f64,
    /// `expandable_segments`.
    pub expandable_segments: bool,
    /// `release_lock_on_cudamalloc` (no effect on memory).
    pub release_lock_on_cudamalloc: bool,
    /// `pinned_use_cuda_host_register` (host allocator only).
    pub pinned_use_cuda_host_register: bool,
    /// `pinned_num_register_threads` (host allocator only).
    pub pinned_num_register_threads: u64,
    /// `pinned_use_background_threads` (host allocator only).
    pub pinned_use_background_threads: bool,
    /// `pinned_reserve_segment_size_mb` (host allocator only).
    pub pinned_reserve_segment_size_mb: u64,
    /// `graph_capture_record_stream_reuse` (CUDA graphs only).
    pub graph_capture_record_stream_reuse: bool,
    /// `per_process_memory_fraction`, when given.
    pub per_process_memory_fraction: Option<f64>,
    /// `large_segment_size_mb` in bytes (default 20 MiB): the 1–10 MiB segment size and the large
    /// expandable page.
    pub large_segment_size: u64,
    /// `pinned_max_round_threshold_mb` as given (host allocator only; 2.15, semantics not modelled).
    pub pinned_max_round_threshold_mb: Option<u64>,
    /// `pinned_max_cached_size_mb` as given (host allocator only; 2.15, semantics not modelled).
    pub pinned_max_cached_size_mb: Option<u64>,
    /// `pinned_free_catch_all` (host allocator only; 2.15).
    pub pinned_free_catch_all: bool,
    /// `throw_on_cudamalloc_oom` (2.15; accepted, not modelled).
    pub throw_on_cudamalloc_oom: bool,
    /// Warnings PyTorch would print while parsing the last settings string (`TORCH_WARN`), plus a note for
    /// each accepted key whose effect vramsim does not model.
    pub warnings: Vec<String>,
}

impl Default for AllocatorConfig {
    fn default() -> Self {
        AllocatorConfig {
            settings: String::new(),
            backend: Backend::Native,
            max_split_size: u64::MAX,
            max_non_split_rounding_size: LARGE_BUFFER,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            expandable_segments: false,
            release_lock_on_cudamalloc: false,
            pinned_use_cuda_host_register: false,
            pinned_num_register_threads: 1,
            pinned_use_background_threads: false,
            pinned_reserve_segment_size_mb: 0,
            graph_capture_record_stream_reuse: false,
            per_process_memory_fraction: None,
            large_segment_size: LARGE_BUFFER,
            pinned_max_round_threshold_mb: None,
            pinned_max_cached_size_mb: None,
            pinned_free_catch_all: false,
            throw_on_cudamalloc_oom: false,
            warnings: Vec::new(),
        }
    }
}

/// The Python exception class PyTorch raises for a rejected settings string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PyException {
    /// `ValueError`: `TORCH_CHECK_VALUE` failures and `std::invalid_argument` from `stoull`/`stod`.
    ValueError,
    /// `IndexError`: `std::out_of_range` from `stoull`/`stod` (a number too large or too small).
    IndexError,
    /// `RuntimeError`: a failed `TORCH_INTERNAL_ASSERT` (a missing token or bracket).
    RuntimeError,
}

/// A settings string PyTorch would reject, with PyTorch's own message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The text PyTorch raises (`str(e)` in Python), byte for byte as PyTorch 2.15.0 prints it.
    pub message: String,
    /// The Python exception class.
    pub exception: PyException,
    /// The key being parsed when the error happened, when there was one.
    pub key: Option<String>,
}

impl ConfigError {
    fn value(message: impl Into<String>) -> ConfigError {
        ConfigError {
            message: message.into(),
            exception: PyException::ValueError,
            key: None,
        }
    }

    /// A failed `TORCH_INTERNAL_ASSERT(cond, msg)` at `file:line` of the 2.15.0 CI build.
    fn internal_assert(cond: &str, file: &str, line: u32, message: &str) -> ConfigError {
        ConfigError {
            message: format!(
                "{cond} INTERNAL ASSERT FAILED at \"/__w/pytorch/pytorch/{file}\":{line}, please report a \
                 bug to PyTorch. {message}"
            ),
            exception: PyException::RuntimeError,
            key: None,
        }
    }

    fn with_key(mut self, key: &str) -> ConfigError {
        if self.key.is_none() {
            self.key = Some(key.to_string());
        }
        self
    }

    /// The message with the key it concerns, for people: `max_split_size_mb: CachingAllocator option ...`.
    pub fn describe(&self) -> String {
        match &self.key {
            Some(key) => format!("{key}: {}", self.message),
            None => self.message.clone(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

impl AllocatorConfig {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string as PyTorch does at start-up: every option starts from
    /// its default. The backend named by the string is taken as the one chosen at load time.
    pub fn parse(settings: &str) -> Result<AllocatorConfig, ConfigError> {
        Parser::run(AllocatorConfig::default(), settings, None)
    }

    /// Applies a settings string on top of this configuration, as
    /// `torch.cuda.memory._set_allocator_settings(settings)` does at run time: `max_split_size`,
    /// `roundup_power2_divisions` and `garbage_collection_threshold` go back to their defaults first,
    /// `max_non_split_rounding` to `large_segment_size`, and every other option keeps its value unless the
    /// string sets it (§12.1). The backend cannot change at run time.
    pub fn apply(&self, settings: &str) -> Result<AllocatorConfig, ConfigError> {
        Parser::run(self.clone(), settings, Some(self.backend))
    }

    /// §12.4 lookup: the divisions that apply to a request of `size` bytes.
    #[inline]
    pub fn roundup_power2_divisions(&self, size: u64) -> u64 {
        let log2 = 63 - size.max(1).leading_zeros() as i64;
        let index = (log2 - 20).clamp(0, 15) as usize;
        self.roundup_power2_divisions[index]
    }

    /// Whether the garbage collector of §5.4 may run (needs a threshold; the memory fraction is checked by
    /// the allocator).
    pub fn garbage_collection_enabled(&self) -> bool {
        self.garbage_collection_threshold > 0.0
    }
}

/// `llvm::isPowerOf2_64`.
fn is_power_of_2(value: u64) -> bool {
    value != 0 && value & (value - 1) == 0
}

/// `c10::CachingAllocator::ConfigTokenizer` (§12.2).
struct Tokens {
    tokens: Vec<String>,
}

impl Tokens {
    fn new(settings: &str) -> Tokens {
        let mut tokens = Vec::new();
        let mut word = String::new();
        for ch in settings.chars() {
            if matches!(ch, ',' | ':' | '[' | ']') {
                // §12.2 separators are tokens of their own.
                if !word.is_empty() {
                    tokens.push(std::mem::take(&mut word));
                }
                tokens.push(ch.to_string());
            } else if !is_c_space(ch) {
                // §12.2 whitespace (std::isspace) is dropped, everything else is glued into a word.
                word.push(ch);
            }
        }
        if !word.is_empty() {
            tokens.push(word);
        }
        Tokens { tokens }
    }

    fn len(&self) -> usize {
        self.tokens.len()
    }

    /// `operator[]`: asserts at AllocatorConfig.h:54.
    fn get(&self, i: usize) -> Result<&str, ConfigError> {
        self.tokens.get(i).map(String::as_str).ok_or_else(|| {
            ConfigError::internal_assert(
                "i < config_.size()",
                "c10/core/AllocatorConfig.h",
                54,
                "Index out of bounds in ConfigTokenizer",
            )
        })
    }

    /// `checkIndex`: asserts at AllocatorConfig.h:123.
    fn at(&self, i: usize) -> Result<&str, ConfigError> {
        self.tokens.get(i).map(String::as_str).ok_or_else(|| {
            ConfigError::internal_assert(
                "i < config_.size()",
                "c10/core/AllocatorConfig.h",
                123,
                "Index out of bounds in ConfigTokenizer",
            )
        })
    }

    /// `checkToken`: the index must exist; whether the token matches is returned and, in PyTorch, mostly
    /// ignored.
    fn check_token(&self, i: usize, token: &str) -> Result<bool, ConfigError> {
        Ok(self.at(i)? == token)
    }

    /// `toSizeT`: `std::stoull`.
    fn to_size_t(&self, i: usize) -> Result<u64, ConfigError> {
        stoull(self.at(i)?)
    }

    /// `toDouble`: `std::stod`.
    fn to_double(&self, i: usize) -> Result<f64, ConfigError> {
        stod(self.at(i)?)
    }

    /// `toBool`: exactly `True` or `False` (§12.2).
    fn to_bool(&self, i: usize) -> Result<bool, ConfigError> {
        match self.at(i)? {
            "True" => Ok(true),
            "False" => Ok(false),
            other => Err(ConfigError::value(format!(
                "Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{other}'"
            ))),
        }
    }

    /// `skipKey`: from a key to the index of its value (or of the `]` closing a list value).
    fn skip_key(&self, i: usize) -> Result<usize, ConfigError> {
        self.check_token(i + 1, ":")?;
        let mut i = i + 2;
        if self.at(i)? != "[" {
            return Ok(i);
        }
        loop {
            i += 1;
            if i >= self.len() || self.tokens[i] == "]" {
                break;
            }
        }
        if i >= self.len() {
            return Err(ConfigError::internal_assert(
                "i < config_.size()",
                "c10/core/AllocatorConfig.h",
                114,
                "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
            ));
        }
        Ok(i)
    }
}

/// C's `isspace` in the "C" locale.
fn is_c_space(ch: char) -> bool {
    matches!(ch, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

/// `std::stoull(s)` (base 10): an optional sign and the longest run of digits; a minus sign negates
/// modulo 2^64 as `strtoull` does. No digits → `ValueError("stoull")`; too many → `IndexError("stoull")`.
fn stoull(s: &str) -> Result<u64, ConfigError> {
    let (negative, rest) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(ConfigError::value("stoull"));
    }
    let value: u64 = rest[..digits].parse().map_err(|_| ConfigError {
        message: "stoull".to_string(),
        exception: PyException::IndexError,
        key: None,
    })?;
    Ok(if negative {
        value.wrapping_neg()
    } else {
        value
    })
}

/// `std::stod(s)`: the longest prefix `strtod` accepts (decimal, hexadecimal, `inf`, `infinity`, `nan`).
/// Nothing accepted → `ValueError("stod")`; a result that overflows to infinity or underflows below the
/// smallest normal double → `IndexError("stod")` (glibc sets ERANGE).
fn stod(s: &str) -> Result<f64, ConfigError> {
    let out_of_range = || ConfigError {
        message: "stod".to_string(),
        exception: PyException::IndexError,
        key: None,
    };
    let bytes = s.as_bytes();
    let (sign, start) = match bytes.first() {
        Some(b'-') => (-1.0, 1),
        Some(b'+') => (1.0, 1),
        _ => (1.0, 0),
    };
    let rest = &s[start..];
    let lower = rest.to_ascii_lowercase();
    if lower.starts_with("inf") {
        return Ok(sign * f64::INFINITY);
    }
    if lower.starts_with("nan") {
        return Ok(f64::NAN);
    }
    let (magnitude, nonzero) = if lower.starts_with("0x")
        && lower[2..]
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_hexdigit() || b == b'.')
    {
        // "0x" without hex digits: strtod reads the "0".
        parse_hex_float(&lower[2..]).unwrap_or((0.0, false))
    } else {
        let rb = rest.as_bytes();
        let int_digits = rb.iter().take_while(|b| b.is_ascii_digit()).count();
        let mut end = int_digits;
        let mut frac_digits = 0;
        if rb.get(end) == Some(&b'.') {
            frac_digits = rb[end + 1..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            end += 1 + frac_digits;
        }
        if int_digits + frac_digits == 0 {
            return Err(ConfigError::value("stod"));
        }
        if matches!(rb.get(end), Some(b'e' | b'E')) {
            let mut exp_end = end + 1;
            if matches!(rb.get(exp_end), Some(b'+' | b'-')) {
                exp_end += 1;
            }
            let exp_digits = rb[exp_end.min(rb.len())..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count();
            if exp_digits > 0 {
                end = exp_end + exp_digits;
            }
        }
        let text = &rest[..end];
        let nonzero = text
            .bytes()
            .take_while(|b| !matches!(b, b'e' | b'E'))
            .any(|b| matches!(b, b'1'..=b'9'));
        // Rust's parser rounds correctly, as glibc's strtod does.
        let value: f64 = text.parse().map_err(|_| ConfigError::value("stod"))?;
        (value, nonzero)
    };
    if magnitude.is_infinite() || (nonzero && magnitude < f64::MIN_POSITIVE) {
        return Err(out_of_range());
    }
    Ok(sign * magnitude)
}

/// The digits of a hexadecimal float after `0x`: `h[.h][p±d]`. Returns the value and whether any digit is
/// non-zero, or `None` when there is no hex digit.
fn parse_hex_float(s: &str) -> Option<(f64, bool)> {
    let b = s.as_bytes();
    let mut mantissa = 0f64;
    let mut exponent: i64 = 0;
    let mut digits = 0;
    let mut nonzero = false;
    let mut i = 0;
    let mut seen_point = false;
    while i < b.len() {
        let c = b[i];
        if c == b'.' && !seen_point {
            seen_point = true;
        } else if let Some(d) = (c as char).to_digit(16) {
            digits += 1;
            nonzero |= d != 0;
            mantissa = mantissa * 16.0 + d as f64;
            if seen_point {
                exponent -= 4;
            }
        } else {
            break;
        }
        i += 1;
    }
    if digits == 0 {
        return None;
    }
    if i < b.len() && b[i] == b'p' {
        let mut j = i + 1;
        let negative = match b.get(j) {
            Some(b'-') => {
                j += 1;
                true
            }
            Some(b'+') => {
                j += 1;
                false
            }
            _ => false,
        };
        let exp_digits = b[j.min(b.len())..]
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count();
        if exp_digits > 0 {
            let e: i64 = s[j..j + exp_digits].parse().unwrap_or(i64::MAX / 2);
            exponent += if negative { -e } else { e };
        }
    }
    Some((
        mantissa * 2f64.powi(exponent.clamp(-2000, 2000) as i32),
        nonzero,
    ))
}

/// One run of PyTorch's two parsers over one settings string.
struct Parser<'a> {
    tokens: Tokens,
    config: AllocatorConfig,
    /// The backend chosen when the library loaded; `None` at start-up, when the string itself chooses.
    load_time_backend: Option<Backend>,
    settings: &'a str,
}

impl<'a> Parser<'a> {
    fn run(
        base: AllocatorConfig,
        settings: &'a str,
        load_time_backend: Option<Backend>,
    ) -> Result<AllocatorConfig, ConfigError> {
        let mut parser = Parser {
            tokens: Tokens::new(settings),
            config: base,
            load_time_backend,
            settings,
        };
        parser.accelerator_pass()?;
        parser.cuda_pass()?;
        Ok(parser.config)
    }

    /// `AcceleratorAllocatorConfig::parseArgs` (c10/core/AllocatorConfig.cpp, 2.15.0).
    fn accelerator_pass(&mut self) -> Result<(), ConfigError> {
        // §12.1 each parse resets these three to their defaults.
        self.config.max_split_size = u64::MAX;
        self.config.roundup_power2_divisions = [0; ROUNDUP_INTERVALS];
        self.config.garbage_collection_threshold = 0.0;
        self.config.settings = self.settings.to_string();
        self.config.warnings.clear();

        // §12.3 large_segment_size_mb is read first: the other minimums depend on it.
        let mut i = 0;
        while i < self.tokens.len() {
            if self.tokens.get(i)? == "large_segment_size_mb" {
                i = self
                    .parse_large_segment_size(i)
                    .map_err(|e| e.with_key("large_segment_size_mb"))?;
            }
            i += 1;
        }
        // §12.1 (2.15) max_non_split_rounding follows large_segment_size unless set below.
        self.config.max_non_split_rounding_size = self.config.large_segment_size;

        let mut i = 0;
        while i < self.tokens.len() {
            let key = self.tokens.get(i)?.to_string();
            i = self
                .accelerator_key(&key, i)
                .map_err(|e| e.with_key(&key))?;
            // The separator is stepped over without being checked.
            if i + 1 < self.tokens.len() {
                self.tokens.check_token(i + 1, ",")?;
                i += 1;
            }
            i += 1;
        }
        Ok(())
    }

    fn accelerator_key(&mut self, key: &str, i: usize) -> Result<usize, ConfigError> {
        let t = &self.tokens;
        match key {
            "large_segment_size_mb" => t.skip_key(i),
            "max_split_size_mb" => {
                let (i, bytes) = self.parse_split_size(i, "max_split_size_mb")?;
                self.config.max_split_size = bytes;
                Ok(i)
            }
            "max_non_split_rounding_mb" => {
                let (i, bytes) = self.parse_split_size(i, "max_non_split_rounding_mb")?;
                self.config.max_non_split_rounding_size = bytes;
                Ok(i)
            }
            "garbage_collection_threshold" => {
                t.check_token(i + 1, ":")?;
                let value = t.to_double(i + 2)?;
                // §12.3 the threshold lies strictly between 0 and 1 (NaN fails too).
                if !(value > 0.0 && value < 1.0) {
                    return Err(ConfigError::value(
                        "garbage_collect_threshold is invalid, set it in (0.0, 1.0)",
                    ));
                }
                self.config.garbage_collection_threshold = value;
                Ok(i + 2)
            }
            "roundup_power2_divisions" => self.parse_roundup_power2_divisions(i),
            "expandable_segments" => {
                t.check_token(i + 1, ":")?;
                self.config.expandable_segments = t.to_bool(i + 2)?;
                Ok(i + 2)
            }
            "pinned_use_background_threads" => {
                t.check_token(i + 1, ":")?;
                self.config.pinned_use_background_threads = t.to_bool(i + 2)?;
                Ok(i + 2)
            }
            "pinned_max_round_threshold_mb" | "pinned_max_cached_size_mb" => {
                t.check_token(i + 1, ":")?;
                let value = t.to_size_t(i + 2)?;
                if key == "pinned_max_round_threshold_mb" {
                    self.config.pinned_max_round_threshold_mb = Some(value);
                } else {
                    self.config.pinned_max_cached_size_mb = Some(value);
                }
                Ok(i + 2)
            }
            _ if CUDA_KEYS.contains(&key) => t.skip_key(i),
            // §12.3 unknown key: the accelerator pass rejects it before the CUDA hook runs (2.10+).
            _ => Err(ConfigError::value(format!(
                "Unrecognized key '{key}' in Accelerator allocator config."
            ))),
        }
    }

    /// `parseLargeSegmentSize`: §12.3 more than 10 MiB.
    fn parse_large_segment_size(&mut self, i: usize) -> Result<usize, ConfigError> {
        let t = &self.tokens;
        t.check_token(i + 1, ":")?;
        let min_mb = MIN_LARGE_ALLOC / MB;
        let value = t.to_size_t(i + 2)?;
        if value <= min_mb {
            return Err(ConfigError::value(format!(
                "CachingAllocator option large_segment_size_mb must be > {min_mb} MB"
            )));
        }
        self.config.large_segment_size = value.min(u64::MAX / MB) * MB;
        Ok(i + 2)
    }

    /// `parseMaxSplitSize` / `parseMaxNonSplitRoundingSize`: §12.3 at least `large_segment_size_mb`
    /// (20 by default), in MiB, clamped to SIZE_MAX / 1 MiB.
    fn parse_split_size(&self, i: usize, key: &str) -> Result<(usize, u64), ConfigError> {
        let t = &self.tokens;
        t.check_token(i + 1, ":")?;
        let min_mb = self.config.large_segment_size / MB;
        let value = t.to_size_t(i + 2)?;
        if value < min_mb {
            return Err(ConfigError::value(format!(
                "CachingAllocator option {key} too small, must be >= {min_mb}"
            )));
        }
        // §12.3 clamp: the largest value is (SIZE_MAX / 1 MiB) MiB = 2^64 − 2^20 bytes.
        Ok((i + 2, value.min(u64::MAX / MB) * MB))
    }

    /// `parseRoundUpPower2Divisions` (§12.4), single-value and list forms.
    fn parse_roundup_power2_divisions(&mut self, i: usize) -> Result<usize, ConfigError> {
        let t = &self.tokens;
        let divisions = &mut self.config.roundup_power2_divisions;
        t.check_token(i + 1, ":")?;
        let mut i = i + 2;
        if t.get(i)? != "[" {
            // §12.4 single value: a power of two (0 is rejected here) for every interval.
            let value = t.to_size_t(i)?;
            if !is_power_of_2(value) {
                return Err(ConfigError::value(
                    "For roundups, the divisions has to be power of 2 ",
                ));
            }
            *divisions = [value; ROUNDUP_INTERVALS];
            return Ok(i);
        }
        let mut first_value = true;
        let mut last_index = 0usize;
        loop {
            i += 1;
            if i >= t.len() || t.get(i)? == "]" {
                break;
            }
            let value_index = i;
            t.check_token(i + 1, ":")?;
            i += 2;
            let value = t.to_size_t(i)?;
            // §12.4 list values: 0 (no rounding) or a power of two.
            if value != 0 && !is_power_of_2(value) {
                return Err(ConfigError::value(
                    "For roundups, the divisions has to be power of 2 or 0 to disable roundup ",
                ));
            }
            if t.get(value_index)? == ">" {
                // §12.4 NEW (2.10+): `>` fills from the entry after the last listed one.
                for entry in divisions.iter_mut().skip(last_index + 1) {
                    *entry = value;
                }
            } else {
                let boundary = t.to_size_t(value_index)?;
                // §12.4 interval keys are sizes in MiB and powers of two.
                if !is_power_of_2(boundary) {
                    return Err(ConfigError::value(
                        "For roundups, the intervals have to be power of 2 ",
                    ));
                }
                // §12.4 entry index = floor(log2(key)), clamped to the 16 entries.
                let index = (63 - boundary.leading_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
                if first_value {
                    // §12.4 the first listed value also covers every entry below it.
                    for entry in divisions.iter_mut().take(index) {
                        *entry = value;
                    }
                    first_value = false;
                }
                divisions[index] = value;
                last_index = index;
            }
            if t.get(i + 1)? != "]" {
                t.check_token(i + 1, ",")?;
                i += 1;
            }
        }
        if i >= t.len() {
            return Err(ConfigError::internal_assert(
                "i < tokenizer.size()",
                "c10/core/AllocatorConfig.cpp",
                213,
                "Expected closing bracket ']' in ConfigTokenizer but reached end of config",
            ));
        }
        Ok(i)
    }

    /// `CUDAAllocatorConfig::parseArgs` (c10/cuda/CUDAAllocatorConfig.cpp, 2.15.0).
    fn cuda_pass(&mut self) -> Result<(), ConfigError> {
        let mut used_malloc_async = false;
        let mut used_native_specific_option = false;
        let mut i = 0;
        while i < self.tokens.len() {
            let key = self.tokens.get(i)?.to_string();
            let (next, native_specific) = self
                .cuda_key(&key, i, &mut used_malloc_async)
                .map_err(|e| e.with_key(&key))?;
            used_native_specific_option |= native_specific;
            i = next;
            if i + 1 < self.tokens.len() {
                self.tokens.check_token(i + 1, ",")?;
                i += 1;
            }
            i += 1;
        }
        if used_malloc_async && used_native_specific_option {
            // §12.3 a warning, not an error.
            self.config
                .warnings
                .push(MALLOC_ASYNC_IGNORES_WARNING.to_string());
        }
        Ok(())
    }

    /// One CUDA key; returns the index of its last token and whether it counts as native-specific.
    fn cuda_key(
        &mut self,
        key: &str,
        i: usize,
        used_malloc_async: &mut bool,
    ) -> Result<(usize, bool), ConfigError> {
        let t = &self.tokens;
        let config = &mut self.config;
        match key {
            "backend" => {
                t.check_token(i + 1, ":")?;
                let value = t.get(i + 2)?;
                // §12.3 backend is native or cudaMallocAsync.
                let backend = match value {
                    "native" => Backend::Native,
                    "cudaMallocAsync" => Backend::CudaMallocAsync,
                    _ => {
                        return Err(ConfigError::value(
                            "Unknown allocator backend, options are native and cudaMallocAsync",
                        ))
                    }
                };
                // §12.3 the backend must match the one chosen when the library loaded.
                if let Some(loaded) = self.load_time_backend {
                    if loaded != backend {
                        return Err(ConfigError::internal_assert(
                            "tokenizer[i] == get()->name()",
                            "c10/cuda/CUDAAllocatorConfig.cpp",
                            64,
                            &format!(
                                "Allocator backend parsed at runtime != allocator backend parsed at \
                                 load time, {} != {}",
                                backend.name(),
                                loaded.name()
                            ),
                        ));
                    }
                }
                *used_malloc_async = backend == Backend::CudaMallocAsync;
                config.backend = backend;
                Ok((i + 2, false))
            }
            "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
                t.check_token(i + 1, ":")?;
                config.release_lock_on_cudamalloc = t.to_bool(i + 2)?;
                Ok((i + 2, true))
            }
            "pinned_use_cuda_host_register" | "pinned_use_hip_host_register" => {
                t.check_token(i + 1, ":")?;
                config.pinned_use_cuda_host_register = t.to_bool(i + 2)?;
                Ok((i + 2, true))
            }
            "pinned_num_register_threads" => {
                t.check_token(i + 1, ":")?;
                let value = t.to_size_t(i + 2)?;
                // §12.3 a power of two, at most 128.
                if !is_power_of_2(value) {
                    return Err(ConfigError::value(format!(
                        "Number of register threads has to be power of 2, got {value}"
                    )));
                }
                if value > PINNED_MAX_REGISTER_THREADS {
                    return Err(ConfigError::value(format!(
                        "Number of register threads should be less than or equal to \
                         {PINNED_MAX_REGISTER_THREADS}, got {value}"
                    )));
                }
                config.pinned_num_register_threads = value;
                Ok((i + 2, true))
            }
            "pinned_reserve_segment_size_mb" => {
                t.check_token(i + 1, ":")?;
                let value = t.to_size_t(i + 2)?;
                // §12.3 more than 0.
                if value == 0 {
                    return Err(ConfigError::value(
                        "Pinned reserve segment size has to be greater than 0",
                    ));
                }
                config.pinned_reserve_segment_size_mb = value;
                Ok((i + 2, true))
            }
            "graph_capture_record_stream_reuse" => {
                t.check_token(i + 1, ":")?;
                config.graph_capture_record_stream_reuse = t.to_bool(i + 2)?;
                Ok((i + 2, true))
            }
            "per_process_memory_fraction" => {
                t.check_token(i + 1, ":")?;
                let value = t.to_double(i + 2)?;
                // §12.3 the fraction lies in [0, 1] (NaN fails).
                if !(0.0..=1.0).contains(&value) {
                    return Err(ConfigError::value(
                        "per_process_memory_fraction is invalid, set it in [0.0, 1.0]",
                    ));
                }
                config.per_process_memory_fraction = Some(value);
                Ok((i + 2, true))
            }
            "pinned_free_catch_all" => {
                t.check_token(i + 1, ":")?;
                config.pinned_free_catch_all = t.to_bool(i + 2)?;
                Ok((i + 2, true))
            }
            "throw_on_cudamalloc_oom" => {
                t.check_token(i + 1, ":")?;
                config.throw_on_cudamalloc_oom = t.to_bool(i + 2)?;
                if config.throw_on_cudamalloc_oom {
                    config.warnings.push(
                        "vramsim does not model throw_on_cudamalloc_oom; ignored".to_string(),
                    );
                }
                Ok((i + 2, true))
            }
            "expandable_segments_reserve" => {
                t.check_token(i + 1, ":")?;
                let value = t.get(i + 2)?.to_string();
                push_reserve_warnings(&mut config.warnings, &value);
                Ok((i + 2, true))
            }
            "expandable_segments_reserve_by_class" => {
                // Format: expandable_segments_reserve_by_class:[name:val,name:val,...]
                t.check_token(i + 1, ":")?;
                t.check_token(i + 2, "[")?;
                let mut i = i + 2;
                while !t.check_token(i + 1, "]")? {
                    t.get(i + 1)?;
                    t.check_token(i + 2, ":")?;
                    let value = t.get(i + 3)?.to_string();
                    i += 3;
                    push_reserve_warnings(&mut config.warnings, &value);
                    if t.check_token(i + 1, ",")? {
                        i += 1;
                    }
                }
                Ok((i + 1, true))
            }
            _ if ACCELERATOR_KEYS.contains(&key) => Ok((t.skip_key(i)?, false)),
            // Unreachable in 2.10+ (the accelerator pass rejects unknown keys first); kept as PyTorch has it.
            _ => Err(ConfigError::value(format!(
                "Unrecognized key '{key}' in CUDA allocator config."
            ))),
        }
    }
}

/// `parseReserveSpec`: a positive fraction (`0.5`) or an absolute size (`40G`). PyTorch warns and keeps
/// its default on a bad value; vramsim does not model the reservation at all and says so.
fn push_reserve_warnings(warnings: &mut Vec<String>, token: &str) {
    let number = token.strip_suffix(['G', 'g']).unwrap_or(token);
    let valid = number
        .parse::<f64>()
        .is_ok_and(|v| v.is_finite() && v > 0.0);
    if !valid {
        warnings.push(format!(
            "Ignoring invalid expandable-segment reserve value '{token}' in PYTORCH_CUDA_ALLOC_CONF \
             (expected a positive, finite fraction like 0.5 or an absolute size like 40G); using default."
        ));
    }
    let note = "vramsim does not model expandable_segments_reserve; ignored";
    if !warnings.iter().any(|w| w == note) {
        warnings.push(note.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenizer_makes_separators_tokens_and_drops_whitespace() {
        let t = Tokens::new(" a : [1,2] ,b\t:c d");
        assert_eq!(
            t.tokens,
            ["a", ":", "[", "1", ",", "2", "]", ",", "b", ":", "cd"]
        );
    }

    #[test]
    fn stoull_follows_strtoull() {
        assert_eq!(stoull("40MB").unwrap(), 40);
        assert_eq!(stoull("+7").unwrap(), 7);
        assert_eq!(stoull("-1").unwrap(), u64::MAX);
        assert_eq!(stoull("0x20").unwrap(), 0);
        assert_eq!(
            stoull("abc").unwrap_err().exception,
            PyException::ValueError
        );
        let big = stoull("18446744073709551616").unwrap_err();
        assert_eq!(
            (big.message.as_str(), big.exception),
            ("stoull", PyException::IndexError)
        );
    }

    #[test]
    fn stod_follows_strtod() {
        assert_eq!(stod("0.5x").unwrap(), 0.5);
        assert_eq!(stod(".5").unwrap(), 0.5);
        assert_eq!(stod("1e-3").unwrap(), 0.001);
        assert_eq!(stod("1e").unwrap(), 1.0);
        assert_eq!(stod("0x0.8p0").unwrap(), 0.5);
        assert_eq!(stod("0x1p-1").unwrap(), 0.5);
        assert!(stod("inf").unwrap().is_infinite());
        assert!(stod("nan").unwrap().is_nan());
        assert_eq!(stod("abc").unwrap_err().message, "stod");
        assert_eq!(
            stod("1e-400").unwrap_err().exception,
            PyException::IndexError
        );
        assert_eq!(
            stod("1e400").unwrap_err().exception,
            PyException::IndexError
        );
        assert_eq!(stod("0e-400").unwrap(), 0.0);
    }
}
