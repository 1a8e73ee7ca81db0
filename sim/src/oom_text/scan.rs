//! Small readers over a one-line message: a size right after or right before a position, an integer.

use super::sizes::{self, Printer, Size};

/// The byte position right after the last character of `s` for which `stop` holds (0 if none).
pub fn after_last(s: &str, stop: impl Fn(char) -> bool) -> usize {
    s.char_indices()
        .rev()
        .find(|(_, c)| stop(*c))
        .map_or(0, |(i, c)| i + c.len_utf8())
}

/// The size that starts at `pos` (after spaces): a number, then (for PyTorch, after one space) a unit.
/// Returns the size and the position after it.
pub fn size_after(s: &str, pos: usize, printer: Printer) -> Option<(Size, usize)> {
    let rest = s.get(pos..)?;
    let skipped = rest.len() - rest.trim_start().len();
    let start = pos + skipped;
    let text = &s[start..];
    let n_len = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    // a trailing '.' ends a sentence, it is not a decimal point
    let number = text[..n_len].trim_end_matches('.');
    if number.is_empty() {
        return None;
    }
    let after_number = start + number.len();
    let rest = &s[after_number..];
    let gap = rest.len() - rest.trim_start().len();
    let unit_text = rest.trim_start();
    let u_len = unit_text
        .find(|c: char| !c.is_ascii_alphabetic())
        .unwrap_or(unit_text.len());
    let unit = &unit_text[..u_len];
    let size = sizes::read(number, unit, printer)?;
    Some((size, after_number + gap + u_len))
}

/// The size that ends right before `end` (before spaces): a number, spaces, a unit.
pub fn size_before(s: &str, end: usize, printer: Printer) -> Option<Size> {
    let head = s.get(..end)?.trim_end();
    let u_start = after_last(head, |c| !c.is_ascii_alphabetic());
    let unit = &head[u_start..];
    let before = head[..u_start].trim_end();
    let n_start = after_last(before, |c| !(c.is_ascii_digit() || c == '.'));
    let number = &before[n_start..];
    if number.is_empty() || unit.is_empty() {
        return None;
    }
    sizes::read(number, unit, printer)
}

/// The unsigned integer at `pos` (after spaces) and the position after it.
pub fn int_after(s: &str, pos: usize) -> Option<(u64, usize)> {
    let rest = s.get(pos..)?;
    let start = pos + (rest.len() - rest.trim_start().len());
    let text = &s[start..];
    let len = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let value = text[..len].parse().ok()?;
    Some((value, start + len))
}

/// The position right after the first `phrase` in `s[from..]`.
pub fn after(s: &str, from: usize, phrase: &str) -> Option<usize> {
    s.get(from..)?.find(phrase).map(|i| from + i + phrase.len())
}

/// The position of the first `phrase` in `s[from..]`.
pub fn at(s: &str, from: usize, phrase: &str) -> Option<usize> {
    s.get(from..)?.find(phrase).map(|i| from + i)
}
