//! Parsing of size arguments: "8", "4K", "64M", "1G" (binary multiples), ranges "MIN:MAX"
//! (doubling, as nccl-tests' -b/-e/-f 2) and comma lists.

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
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{s}' is too large"))
}

/// "8:64M" → 8, 16, …, 64M; "4K,1M" → 4K, 1M.
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    if let Some((lo, hi)) = s.split_once(':') {
        let (lo, hi) = (parse_bytes(lo)?, parse_bytes(hi)?);
        if lo == 0 || lo > hi {
            return Err(format!("size range '{s}' must satisfy 0 < MIN <= MAX"));
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
    }
}
