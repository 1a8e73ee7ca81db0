//! A pasted message made into one line: what terminals, forums and chats do to text is undone before
//! any phrase is looked for.
//!
//! Undone: line wraps (lines are joined with a space), indentation, quote and comment markers at the
//! start of a line (`>`, `#`, `//`, `|`, as a paste in an e-mail, a Python comment or a Markdown quote
//! has them), a shell continuation `\` at the end of a line, and runs of whitespace (a wrapped number is
//! left split: `3.23            GiB` reads fine, `1.7 7 GiB` does not). Prefixes such as `RuntimeError:`
//! need nothing: phrases are looked for anywhere.

/// The text on one line, whitespace runs collapsed to one space.
pub fn one_line(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let mut line = line.trim();
        // strip quote/comment markers, repeatedly ("> # ...")
        loop {
            let stripped = ["//", "#", ">", "|"]
                .iter()
                .find_map(|m| line.strip_prefix(m))
                .map(str::trim_start);
            match stripped {
                Some(rest) if rest.len() < line.len() => line = rest,
                _ => break,
            }
        }
        let line = line.strip_suffix('\\').unwrap_or(line).trim_end();
        if line.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(line);
    }
    let mut collapsed = String::with_capacity(out.len());
    let mut space = false;
    for c in out.chars() {
        if c.is_whitespace() {
            if !space {
                collapsed.push(' ');
            }
            space = true;
        } else {
            collapsed.push(c);
            space = false;
        }
    }
    collapsed
}

#[cfg(test)]
mod tests {
    use super::one_line;

    #[test]
    fn wraps_markers_and_indentation_are_undone() {
        let text = "# RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB already\n\
                    # allocated; 47.06 MiB free)\n   > Tried to allocate \\\n4.03 GiB.";
        assert_eq!(
            one_line(text),
            "RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB already \
             allocated; 47.06 MiB free) Tried to allocate 4.03 GiB."
        );
    }
}
