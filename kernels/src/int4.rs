//! The device layout of GPTQ int4 weights that [`crate::ops::MatmulInt4`] reads, built on the
//! host at load time ([`Int4Host`]), and its plain reference meaning ([`Int4Host::dequantize`]).
//!
//! Owns: the repacking of a GPTQ linear (qweight [K/8, N] as stored, zeros, scales, g_idx)
//! into the N-major layout the GPU kernel streams (`kernels/src/gpu/gemv_q4.cu` says why
//! N-major), with `desc_act`'s input order made contiguous per group through a `perm`.
//! Must not: read checkpoints (the rank crate does, and converts its `QuantLinear` with
//! [`Int4Host::from_gptq`]) or touch device memory.
//!
//! Layout of one linear of `n` outputs over `kq` stored inputs in `groups` groups of `group`
//! consecutive stored inputs (`kq = groups · group`):
//!
//! | buffer | dtype | shape | holds |
//! | --- | --- | --- | --- |
//! | `qweight` | u32 | [n, kq/8] | q of (row, stored input j): bits 4·(j mod 8) of word [row][j/8] |
//! | `scales` | f16 | [n, groups] | s of (row, group) |
//! | `zeros` | u32 | [n, ⌈groups/8⌉] | z of (row, group): bits 4·(g mod 8) of word [row][g/8] |
//! | `perm` | u32 | [kq] | the input (column of x) stored input j multiplies; absent: j |
//!
//! `y[row] = Σ_j x[perm[j]] · (q[row][j] − z[row][g(j)]) · s[row][g(j)]`, g(j) = j / group.
//! Without `desc_act` (g_idx runs of equal length) there is no `perm` and `kq = k`. With it,
//! the inputs are sorted by group (stable), and a group holding fewer inputs than the longest
//! (the edges of a row-parallel shard of a `desc_act` layer) is padded with entries whose q is
//! the group's z: they add x · 0.

/// int4 values per u32 word (along the stored inputs), and zero points per `zeros` word.
pub const PACK: usize = 8;

/// One quantized linear in the device layout (see the module header), on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Int4Host {
    /// Output rows.
    pub n: usize,
    /// Inputs: the length of a row of x (what `perm` indexes).
    pub k: usize,
    /// Stored inputs per group (a multiple of 8).
    pub group: usize,
    /// Groups.
    pub groups: usize,
    /// [n, groups · group / 8].
    pub qweight: Vec<u32>,
    /// f16 bits, [n, groups].
    pub scales: Vec<u16>,
    /// [n, ⌈groups / 8⌉].
    pub zeros: Vec<u32>,
    /// [groups · group], each < k; `None`: stored input j is input j (and kq = k).
    pub perm: Option<Vec<u32>>,
}

impl Int4Host {
    /// Stored inputs per row: `groups · group`.
    pub fn kq(&self) -> usize {
        self.groups * self.group
    }

    /// Words of `zeros` per row for `groups` groups.
    pub fn zero_words(groups: usize) -> usize {
        groups.div_ceil(PACK)
    }

    /// The int4 value of (row, stored input j).
    pub fn q(&self, row: usize, j: usize) -> u8 {
        let w = self.qweight[row * self.kq() / PACK + j / PACK];
        ((w >> (4 * (j % PACK))) & 0xf) as u8
    }

    /// The zero point of (row, group).
    pub fn zero(&self, row: usize, g: usize) -> u8 {
        let w = self.zeros[row * Self::zero_words(self.groups) + g / PACK];
        ((w >> (4 * (g % PACK))) & 0xf) as u8
    }

    /// The scale of (row, group).
    pub fn scale(&self, row: usize, g: usize) -> f32 {
        half::f16::from_bits(self.scales[row * self.groups + g]).to_f32()
    }

    /// Bytes the matrix–vector product must read: qweight, scales, zeros and perm.
    pub fn bytes(&self) -> usize {
        4 * self.qweight.len()
            + 2 * self.scales.len()
            + 4 * self.zeros.len()
            + 4 * self.perm.as_ref().map_or(0, Vec::len)
    }

    /// The weights as f32, [n, k] row-major: `w[row][perm[j]] += (q − z) · s` (each
    /// `(q − z) · s` is exact in f32: 5 bits times an f16's 11).
    pub fn dequantize(&self) -> Vec<f32> {
        let (n, k) = (self.n, self.k);
        let mut w = vec![0f32; n * k];
        for row in 0..n {
            for j in 0..self.kq() {
                let g = j / self.group;
                let col = self.perm.as_ref().map_or(j, |p| p[j] as usize);
                let q = f32::from(self.q(row, j)) - f32::from(self.zero(row, g));
                w[row * k + col] += q * self.scale(row, g);
            }
        }
        w
    }

    /// The layers' rows one after another (gate | up, q | k | v as one product), for layers
    /// of the same inputs in the same layout: the same k, group, groups and perm. GPTQ
    /// quantizes each module on its own, so `desc_act` layers usually differ in perm and
    /// cannot be fused this way (an error says so).
    pub fn concat_rows(parts: &[Int4Host]) -> Result<Int4Host, String> {
        let Some(first) = parts.first() else {
            return Err("int4: nothing to concatenate".into());
        };
        let same = |h: &Int4Host| {
            (h.k, h.group, h.groups, &h.perm) == (first.k, first.group, first.groups, &first.perm)
        };
        if let Some(h) = parts.iter().find(|h| !same(h)) {
            return Err(format!(
                "int4: layers of different input layouts cannot share one product (k {} vs {}, \
                 {} groups of {} vs {} of {}, perm {} vs {})",
                first.k,
                h.k,
                first.groups,
                first.group,
                h.groups,
                h.group,
                if first.perm.is_some() {
                    "given"
                } else {
                    "none"
                },
                if h.perm == first.perm {
                    "the same"
                } else {
                    "different"
                },
            ));
        }
        let cat = |f: fn(&Int4Host) -> &Vec<u32>| parts.iter().flat_map(f).copied().collect();
        Ok(Int4Host {
            n: parts.iter().map(|h| h.n).sum(),
            qweight: cat(|h| &h.qweight),
            zeros: cat(|h| &h.zeros),
            scales: parts.iter().flat_map(|h| &h.scales).copied().collect(),
            ..first.clone()
        })
    }

    /// Repacks a GPTQ linear (or a rank's slice of one): `qweight` [k/8, n] as stored (8
    /// nibbles along k per word), `zeros` [groups, n] unpacked zero points (the convention
    /// already applied), `scales` [groups, n] (f16 values), `g_idx` [k]: the group of each
    /// input, counted from the first of `groups` rows of `zeros` and `scales`.
    ///
    /// Without a `perm` when the groups are consecutive runs of one length (a multiple of 8);
    /// otherwise inputs are sorted by group and every group padded to the longest.
    pub fn from_gptq(
        n: usize,
        k: usize,
        qweight: &[u32],
        zeros: &[u8],
        scales: &[f32],
        g_idx: &[u32],
    ) -> Result<Int4Host, String> {
        if n == 0 || k == 0 || !k.is_multiple_of(PACK) {
            return Err(format!(
                "int4: [{n}, {k}]: k must be a positive multiple of 8"
            ));
        }
        if qweight.len() != k / PACK * n || g_idx.len() != k {
            return Err(format!(
                "int4: qweight of {} words and g_idx of {} for [{n}, {k}]",
                qweight.len(),
                g_idx.len()
            ));
        }
        let ng = scales.len() / n;
        if scales.len() != ng * n || zeros.len() != ng * n {
            return Err(format!(
                "int4: {} scales and {} zeros are not rows of {n}",
                scales.len(),
                zeros.len()
            ));
        }
        if let Some(&g) = g_idx.iter().find(|&&g| g as usize >= ng) {
            return Err(format!("int4: g_idx {g} is outside the {ng} groups given"));
        }
        if let Some(&z) = zeros.iter().find(|&&z| z > 15) {
            return Err(format!("int4: zero point {z} is not 4 bits"));
        }
        let mut count = vec![0usize; ng];
        for &g in g_idx {
            count[g as usize] += 1;
        }
        let present: Vec<usize> = (0..ng).filter(|&g| count[g] > 0).collect();
        let longest = count.iter().copied().max().unwrap_or(0);
        let runs = present.len() == ng
            && count.iter().all(|&c| c == longest)
            && longest.is_multiple_of(PACK)
            && g_idx.windows(2).all(|p| p[0] <= p[1]);
        let group = longest.next_multiple_of(PACK);
        // order[j]: the input stored at j (None: padding), and the source group of each
        // stored group.
        let order: Vec<Option<usize>> = if runs {
            (0..k).map(Some).collect()
        } else {
            let mut by_group: Vec<Vec<usize>> = vec![Vec::new(); ng];
            for (col, &g) in g_idx.iter().enumerate() {
                by_group[g as usize].push(col);
            }
            present
                .iter()
                .flat_map(|&g| {
                    let cols = &by_group[g];
                    (0..group).map(move |i| cols.get(i).copied())
                })
                .collect()
        };
        let groups = present.len();
        let kq = groups * group;
        let zw = Self::zero_words(groups);
        let mut out = Int4Host {
            n,
            k,
            group,
            groups,
            qweight: vec![0; n * kq / PACK],
            scales: vec![0; n * groups],
            zeros: vec![0; n * zw],
            perm: (!runs).then(|| {
                order
                    .iter()
                    .enumerate()
                    // Padding multiplies x[first input of its group] by q − z = 0.
                    .map(|(j, c)| c.unwrap_or_else(|| order[j - j % group].unwrap_or(0)) as u32)
                    .collect()
            }),
        };
        let words = kq / PACK;
        if runs {
            // The stored inputs are the inputs in order, so word w of row `row` is qweight's
            // word [w, row] as it is (the same 8 nibbles in the same places): a transpose,
            // done in tiles so that both sides move in whole cache lines (walking a column of
            // qweight missed the cache at every word: minutes for a 27B model's MLPs).
            const TILE: usize = 64;
            for r0 in (0..n).step_by(TILE) {
                for w0 in (0..words).step_by(TILE) {
                    for w in w0..(w0 + TILE).min(words) {
                        for row in r0..(r0 + TILE).min(n) {
                            out.qweight[row * words + w] = qweight[w * n + row];
                        }
                    }
                }
            }
        }
        for row in 0..n {
            for (sg, &g) in present.iter().enumerate() {
                let z = zeros[g * n + row];
                out.zeros[row * zw + sg / PACK] |= u32::from(z) << (4 * (sg % PACK));
                out.scales[row * groups + sg] = half::f16::from_f32(scales[g * n + row]).to_bits();
                if runs {
                    continue;
                }
                for i in 0..group {
                    let j = sg * group + i;
                    let q = match order[j] {
                        Some(col) => (qweight[col / PACK * n + row] >> (4 * (col % PACK))) & 0xf,
                        None => u32::from(z),
                    };
                    out.qweight[row * words + j / PACK] |= q << (4 * (j % PACK));
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// A random GPTQ layer: (qweight [k/8, n], zeros [ng, n], scales [ng, n], g_idx [k]).
    pub(crate) fn gptq(
        rng: &mut Rng,
        n: usize,
        k: usize,
        ng: usize,
    ) -> (Vec<u32>, Vec<u8>, Vec<f32>) {
        let qweight = (0..k / PACK * n).map(|_| rng.next_u64() as u32).collect();
        let zeros = (0..ng * n).map(|_| (rng.next_u64() % 16) as u8).collect();
        let scales = (0..ng * n)
            .map(|_| half::f16::from_f32(0.01 + rng.f64() as f32 * 0.1).to_f32())
            .collect();
        (qweight, zeros, scales)
    }

    /// GPTQ's own meaning, [n, k]: w[row][col] = (q − z[g(col)]) · s[g(col)].
    fn gptq_dequant(
        n: usize,
        k: usize,
        qw: &[u32],
        z: &[u8],
        s: &[f32],
        g_idx: &[u32],
    ) -> Vec<f32> {
        let mut w = vec![0f32; n * k];
        for col in 0..k {
            let g = g_idx[col] as usize;
            for row in 0..n {
                let q = (qw[col / PACK * n + row] >> (4 * (col % PACK))) & 0xf;
                w[row * k + col] = (q as f32 - z[g * n + row] as f32) * s[g * n + row];
            }
        }
        w
    }

    #[test]
    fn runs_need_no_perm_and_keep_the_values() {
        let mut rng = Rng::new(3);
        let (n, k) = (16usize, 256usize);
        for gl in [32usize, 64, 128, 256] {
            let g_idx: Vec<u32> = (0..k).map(|c| (c / gl) as u32).collect();
            let (qw, z, s) = gptq(&mut rng, n, k, k / gl);
            let h = Int4Host::from_gptq(n, k, &qw, &z, &s, &g_idx).unwrap();
            assert!(h.perm.is_none());
            assert_eq!((h.group, h.groups, h.kq()), (gl, k / gl, k));
            assert_eq!(h.dequantize(), gptq_dequant(n, k, &qw, &z, &s, &g_idx));
        }
    }

    /// The transposing path over shapes that leave partial 64 × 64 tiles on both sides.
    #[test]
    fn runs_transpose_across_partial_tiles() {
        let mut rng = Rng::new(9);
        let (n, k, gl) = (136usize, 8 * 70, 40usize);
        let g_idx: Vec<u32> = (0..k).map(|c| (c / gl) as u32).collect();
        let (qw, z, s) = gptq(&mut rng, n, k, k / gl);
        let h = Int4Host::from_gptq(n, k, &qw, &z, &s, &g_idx).unwrap();
        for row in 0..n {
            for w in 0..k / PACK {
                assert_eq!(h.qweight[row * k / PACK + w], qw[w * n + row]);
            }
        }
        assert_eq!(h.dequantize(), gptq_dequant(n, k, &qw, &z, &s, &g_idx));
    }

    #[test]
    fn desc_act_and_ragged_groups_are_sorted_and_padded() {
        let mut rng = Rng::new(4);
        let (n, k, gl) = (8usize, 128usize, 32usize);
        // desc_act: a permuted order, every group full.
        let mut order: Vec<usize> = (0..k).collect();
        for i in (1..k).rev() {
            order.swap(i, rng.next_u64() as usize % (i + 1));
        }
        let mut g_idx = vec![0u32; k];
        for (pos, &c) in order.iter().enumerate() {
            g_idx[c] = (pos / gl) as u32;
        }
        let (qw, z, s) = gptq(&mut rng, n, k, k / gl);
        let h = Int4Host::from_gptq(n, k, &qw, &z, &s, &g_idx).unwrap();
        assert_eq!((h.group, h.groups), (gl, 4));
        let perm = h.perm.as_ref().unwrap();
        let mut seen = perm.clone();
        seen.sort();
        assert_eq!(seen, (0..k as u32).collect::<Vec<_>>());
        assert_eq!(h.dequantize(), gptq_dequant(n, k, &qw, &z, &s, &g_idx));

        // A slice of it: ragged groups (one absent), padded to the longest.
        let g_cut: Vec<u32> = g_idx[..40].iter().map(|&g| g.max(1) - 1).collect();
        let qcut = qw[..40 / PACK * n].to_vec();
        let h = Int4Host::from_gptq(n, 40, &qcut, &z, &s, &g_cut).unwrap();
        assert!(h.kq() >= 40 && h.group.is_multiple_of(8));
        assert_eq!(h.dequantize(), gptq_dequant(n, 40, &qcut, &z, &s, &g_cut));
    }

    #[test]
    fn rows_of_one_layout_concatenate() {
        let mut rng = Rng::new(5);
        let (k, gl) = (128usize, 32usize);
        let g_idx: Vec<u32> = (0..k).map(|c| (c / gl) as u32).collect();
        let mk = |rng: &mut Rng, n: usize| {
            let (qw, z, s) = gptq(rng, n, k, k / gl);
            Int4Host::from_gptq(n, k, &qw, &z, &s, &g_idx).unwrap()
        };
        let (a, b) = (mk(&mut rng, 16), mk(&mut rng, 24));
        let c = Int4Host::concat_rows(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(c.n, 40);
        let mut want = a.dequantize();
        want.extend(b.dequantize());
        assert_eq!(c.dequantize(), want);
        // Another group size: refused.
        let g64: Vec<u32> = (0..k).map(|c| (c / 64) as u32).collect();
        let (qw, z, s) = gptq(&mut rng, 8, k, 2);
        let d = Int4Host::from_gptq(8, k, &qw, &z, &s, &g64).unwrap();
        assert!(Int4Host::concat_rows(&[a, d]).is_err());
        assert!(Int4Host::concat_rows(&[]).is_err());
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(Int4Host::from_gptq(8, 12, &[0; 12], &[0; 8], &[1.0; 8], &[0; 12]).is_err());
        assert!(Int4Host::from_gptq(8, 8, &[0; 8], &[0; 8], &[1.0; 8], &[1; 8]).is_err());
        assert!(Int4Host::from_gptq(8, 8, &[0; 8], &[16; 8], &[1.0; 8], &[0; 8]).is_err());
    }
}
