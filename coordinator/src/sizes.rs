//! Parsing of size arguments: "8", "4K", "64M", "1G" (binary multiples), ranges "MIN:MAX"
//! (doubling, as nccl-tests' -b/-e/-f 2) and comma lists; every size from 1 byte to
//! [`MAX_MESSAGE_BYTES`].

use crate::cli::MAX_MESSAGE_BYTES;

/// `--sizes`, parsed: message sizes in bytes, in the order given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ByteSizes(pub Vec<usize>);

/// `--sizes`' value parser.
pub fn byte_sizes(s: &str) -> Result<ByteSizes, String> {
    parse_sizes(s).map(ByteSizes)
}

pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 8, 4K, 64M)"))?;
    match n.checked_mul(mult) {
        Some(0) => Err(format!("'{s}': a size must be at least 1 byte")),
        Some(b) if b <= MAX_MESSAGE_BYTES => Ok(b),
        _ => Err(format!(
            "'{s}' is too large: at most {}G per message",
            MAX_MESSAGE_BYTES >> 30
        )),
    }
}

/// "8:64M" → 8, 16, …, 64M; "4K,1M" → 4K, 1M.
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    if let Some((lo, hi)) = s.split_once(':') {
        let (lo, hi) = (parse_bytes(lo)?, parse_bytes(hi)?);
        if lo > hi {
            return Err(format!("size range '{s}' must satisfy MIN <= MAX"));
        }
        let mut v = Vec::new();
        let mut x = lo;
        while x <= hi {
            v.push(x);
            x = x.checked_mul(2).ok_or("size range overflows")?;
        }
        Ok(v)
    } else {
        s.split(',').map(parse_bytes).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_ranges_and_lists() {
        assert_eq!(parse_bytes("4K"), Ok(4096));
        assert_eq!(parse_bytes("64M"), Ok(64 << 20));
        assert_eq!(parse_sizes("8:64"), Ok(vec![8, 16, 32, 64]));
        assert_eq!(parse_sizes("4K,1M"), Ok(vec![4096, 1 << 20]));
        assert!(parse_sizes("64:8").is_err());
        assert!(parse_sizes("x").is_err());
        assert!(parse_bytes("99999999999999999999G").is_err());
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("17G").is_err());
        assert_eq!(parse_bytes("16G"), Ok(MAX_MESSAGE_BYTES));
        assert!(parse_sizes("1:32G").is_err());
        assert!(parse_sizes("8,,16").is_err());
    }
}
