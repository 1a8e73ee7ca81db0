//! `--freeze PATTERN,...`: `requires_grad_(False)` on the parameters under module paths.
//!
//! A pattern is a dotted module path (`model.embed_tokens`, `transformer.h.3.mlp`) or a full
//! parameter name; it matches a parameter whose name starts with the pattern's components, where a
//! component `A-B` stands for every integer from A to B (`model.layers.0-15`).

use super::FinetuneError;
use crate::graph::Graph;
use std::collections::BTreeMap;

/// Whether the pattern component `pat` matches the name component `comp` (`A-B`: an integer
/// range).
fn component_matches(pat: &str, comp: &str) -> bool {
    if let Some((lo, hi)) = pat.split_once('-') {
        if let (Ok(lo), Ok(hi), Ok(c)) = (lo.parse::<u64>(), hi.parse::<u64>(), comp.parse::<u64>())
        {
            return lo <= c && c <= hi;
        }
    }
    pat == comp
}

/// Whether `name` (a parameter or module path) lies under the module path `pattern`.
pub fn path_matches(pattern: &str, name: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let n: Vec<&str> = name.split('.').collect();
    p.len() <= n.len() && p.iter().zip(&n).all(|(a, b)| component_matches(a, b))
}

/// Condenses module paths for a message: numbered components of paths that differ only there
/// become ranges (`model.layers.0-21.mlp.up_proj`), in first-seen order.
pub fn condense(paths: impl IntoIterator<Item = String>) -> Vec<String> {
    // template (numbers replaced by `#`) -> (first position, per numbered slot: min, max)
    let mut groups: BTreeMap<String, (usize, Vec<(u64, u64)>)> = BTreeMap::new();
    for (i, path) in paths.into_iter().enumerate() {
        let comps: Vec<&str> = path.split('.').collect();
        let template = comps
            .iter()
            .map(|c| if c.parse::<u64>().is_ok() { "#" } else { c })
            .collect::<Vec<_>>()
            .join(".");
        let nums: Vec<u64> = comps.iter().filter_map(|c| c.parse().ok()).collect();
        let e = groups
            .entry(template)
            .or_insert_with(|| (i, nums.iter().map(|&n| (n, n)).collect()));
        for (slot, &n) in e.1.iter_mut().zip(&nums) {
            slot.0 = slot.0.min(n);
            slot.1 = slot.1.max(n);
        }
    }
    let mut out: Vec<(usize, String)> = groups
        .into_iter()
        .map(|(template, (first, ranges))| {
            let mut r = ranges.iter();
            let s: Vec<String> = template
                .split('.')
                .map(|c| match (c, if c == "#" { r.next() } else { None }) {
                    (_, Some((lo, hi))) if lo == hi => lo.to_string(),
                    (_, Some((lo, hi))) => format!("{lo}-{hi}"),
                    _ => c.to_string(),
                })
                .collect();
            (first, s.join("."))
        })
        .collect();
    out.sort();
    out.into_iter().map(|(_, s)| s).collect()
}

/// The modules that own parameters (a parameter's name without its last component), condensed
/// ([`condense`]), in registration order.
pub fn module_listing(g: &Graph) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mods: Vec<String> = g
        .params
        .iter()
        .map(|p| p.name.rsplit_once('.').map_or("", |(m, _)| m).to_string())
        .filter(|m| seen.insert(m.clone()))
        .collect();
    condense(mods)
}

/// Freezes (`requires_grad_(False)`) every parameter under one of `patterns`; a pattern that
/// matches no parameter is an error listing the model's modules. Returns the number of parameter
/// elements frozen by this call.
pub fn freeze(g: &mut Graph, patterns: &[String]) -> Result<u64, FinetuneError> {
    for pat in patterns {
        if !g.params.iter().any(|p| path_matches(pat, &p.name)) {
            return Err(FinetuneError::FreezeNoMatch {
                model: g.name.clone(),
                pattern: pat.clone(),
                modules: module_listing(g),
            });
        }
    }
    let mut n = 0;
    for p in &mut g.params {
        if p.trainable && patterns.iter().any(|pat| path_matches(pat, &p.name)) {
            p.trainable = false;
            n += crate::layout::numel(&p.shape);
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_prefixes() {
        assert!(path_matches(
            "model.layers.0-15",
            "model.layers.15.mlp.up_proj.weight"
        ));
        assert!(!path_matches(
            "model.layers.0-15",
            "model.layers.16.mlp.up_proj.weight"
        ));
        assert!(path_matches(
            "model.embed_tokens",
            "model.embed_tokens.weight"
        ));
        assert!(!path_matches("model.embed", "model.embed_tokens.weight"));
        assert!(path_matches("0", "0.weight"));
        assert!(!path_matches("0", "10.weight"));
    }

    #[test]
    fn condensed_listing() {
        let paths =
            ["a.0.q", "a.0.v", "a.1.q", "a.1.v", "a.7.q", "a.7.v", "head"].map(String::from);
        assert_eq!(condense(paths), vec!["a.0-7.q", "a.0-7.v", "head"]);
    }
}
